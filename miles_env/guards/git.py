"""`scrub_git`: make a repository in a sandbox hold only the task's starting state.

Concept: a task built from a real repository often carries its future: the fix on a later
commit that a branch, a tag, a remote, the reflog, `ORIG_HEAD`, a stash or a pack still reach.
An environment calls `await scrub_git(sandbox, "repo", "abc123")` in `setup`: the repository is
left on one branch at the starting commit (its ancestors stay: history up to the start is part
of the task) with no other ref, no remote, no reflog, and every object the starting commit does
not reach pruned from loose objects and packs. It then checks its own work: an object outside
the starting state that survived is a SandboxError naming it.

Invariant: after a successful scrub, `git cat-file --batch-all-objects` lists only objects
reachable from the starting commit. Lifecycle: once per episode, in setup, before the agent.
"""

from __future__ import annotations

import shlex

from miles_env.errors import SandboxError
from miles_env.sandbox import Sandbox

__all__ = ["scrub_git"]

_SCRIPT = r"""
set -e
cd "$REPO"
start=$(git rev-parse --verify "$START^{commit}")
git checkout -q --detach "$start"
git for-each-ref --format='%(refname)' | while read -r ref; do git update-ref -d "$ref"; done
git checkout -q -B "$BRANCH" "$start"
for r in $(git remote); do git remote remove "$r"; done
rm -rf .git/logs .git/refs/original .git/refs/stash .git/ORIG_HEAD .git/FETCH_HEAD .git/MERGE_HEAD \
  .git/CHERRY_PICK_HEAD .git/REBASE_HEAD .git/rebase-merge .git/rebase-apply .git/modules .git/shallow \
  .git/COMMIT_EDITMSG .git/MERGE_MSG .git/SQUASH_MSG .git/info/refs
git reflog expire --expire=now --all
git -c gc.reflogExpire=now -c gc.reflogExpireUnreachable=now -c gc.rerereresolved=now \
  gc -q --prune=now
git repack -a -d -q
git prune --expire=now
test "$(git cat-file --batch-all-objects --batch-check='%(objectname)' | sort)" = \
  "$(git rev-list --objects "$start" | cut -d' ' -f1 | sort)" || { echo "objects outside $start remain" >&2; exit 3; }
"""


async def scrub_git(sandbox: Sandbox, repo: str, start: str = "HEAD", *, branch: str = "main") -> str:
    """Leave `repo` (relative to the workdir, or absolute) holding only `start` and its ancestors,
    on `branch`; return the starting commit's id."""
    env = {
        "REPO": repo,
        "START": start,
        "BRANCH": branch,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "miles-env",
        "GIT_AUTHOR_EMAIL": "miles-env@localhost",
        "GIT_COMMITTER_NAME": "miles-env",
        "GIT_COMMITTER_EMAIL": "miles-env@localhost",
    }
    res = await sandbox.exec(["sh", "-c", _SCRIPT], timeout=300, env=env)
    if not res.ok:
        where = f"{repo!r} at {start!r}"
        raise SandboxError(f"scrub_git {where}: {res.stderr.strip()[-300:] or f'exit {res.exit_code}'}")
    head = await sandbox.exec(["git", "-C", repo, "rev-parse", "HEAD"], timeout=30)
    return head.stdout.strip() or shlex.quote(start)
