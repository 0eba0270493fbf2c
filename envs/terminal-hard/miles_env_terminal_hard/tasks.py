"""Task definitions of terminal-hard: multi-step tasks for capable models.

Each task gives starting files, an instruction that states the goal and the exact
output format, checks that also probe inputs the instruction does not show (so a
hard-coded answer fails), and a reference solution. `protected` names the files the
agent must leave as they were (its tests; miles_env.guards flags and restores them).
A task with `future` starts in a git repository whose later commit holds those files
(the answer, as a real project's history would); setup scrubs it back to the first
commit, so no ref, reflog or object of the future is left for the agent to read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["HardTask", "TASKS"]


@dataclass(frozen=True, slots=True)
class HardTask:
    id: str
    split: str
    category: str
    instruction: str
    checks: list[dict[str, Any]]
    solution: str
    files: dict[str, str] = field(default_factory=dict)
    protected: tuple[str, ...] = ()  # paths the agent must not change (the task's tests)
    future: dict[str, str] | None = None  # a later commit's files: the workdir is a scrubbed repo


def _cmd(cmd: str, stdout: str | None = None, exit_code: int | None = 0) -> dict[str, Any]:
    return {"kind": "command", "cmd": cmd, "stdout_equals": stdout, "exit_code": exit_code}


def _eq(path: str, text: str, strip: bool = True) -> dict[str, Any]:
    return {"kind": "file_equals", "path": path, "text": text, "strip": strip}


_SUM_SH = """#!/bin/sh
# Print the sum of the numbers in the file given as the first argument (one number per line).
total=0
while read n; do
  total=$((total + m))
done < "$1"
echo "$totl"
"""

_FIZZ_TEST = """from fizzbuzz import fizzbuzz

assert fizzbuzz(1) == "1"
assert fizzbuzz(3) == "Fizz"
assert fizzbuzz(5) == "Buzz"
assert fizzbuzz(15) == "FizzBuzz"
assert fizzbuzz(7) == "7"
print("ok")
"""

_STATS_PY = """def mean(xs):
    return sum(xs) / len(xs)


def median(xs):
    ys = sorted(xs)
    mid = len(ys) // 2
    return ys[mid]
"""

_STATS_TEST = """from stats import mean, median

assert mean([1, 2, 3]) == 2
assert median([3, 1, 2]) == 2
assert median([4, 1, 3, 2]) == 2.5
assert median([10, 20]) == 15
print("ok")
"""

_ACCESS_LOG = """2024-05-01T10:00:01 GET /index.html 200 512
2024-05-01T10:00:02 GET /missing 404 0
2024-05-01T10:00:05 POST /login 200 128
2024-05-01T10:01:00 GET /admin 403 0
2024-05-01T10:01:30 GET /index.html 200 512
2024-05-01T10:02:10 GET /api/data 500 64
2024-05-01T10:03:00 GET /missing 404 0
2024-05-01T10:03:30 GET /index.html 200 512
"""

_SALES = """region,amount
north,120
south,75
east,30
north,80
west,55
south,25
east,70
"""

_USERS = """[
  {"name": "ann", "email": "ann@example.com", "active": true},
  {"name": "bob", "email": "bob@example.com", "active": false},
  {"name": "cy", "email": "cy@example.org", "active": true},
  {"name": "dee", "email": "dee@example.net", "active": true},
  {"name": "ed", "email": "ed@example.com", "active": false}
]
"""

_TEXT = """The cat sat. The dog ran; the cat slept!
A dog and one cat. The end, THE last.
"""

_EMAILS = "zoe@x.org\nann@x.org\nzoe@x.org\nbob@x.org\nann@x.org\ncy@x.org\n"

_PROJECT = {
    "project/main.py": "print('hi')\n",
    "project/README.md": "# demo\n",
    "project/lib/util.py": "X = 1\n",
}

_SLUG_PY = """import re


def slugify(text):
    return re.sub(r"[^a-z0-9]", "-", text.lower())
"""

_SLUG_FIXED = """import re


def slugify(text):
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
"""

_SLUG_TEST = """from slug import slugify

assert slugify("Hello, World!") == "hello-world"
assert slugify("  Miles  env ") == "miles-env"
assert slugify("a") == "a"
print("ok")
"""

_ORGANIZE = {"a.txt": "a\n", "b.txt": "b\n", "c.log": "c\n", "d.csv": "d\n", "e.log": "e\n"}

TASKS: list[HardTask] = [
    HardTask(
        "fix-sum-script", "train", "debug",
        "The shell script sum.sh should print the sum of the numbers (one per line) in the file named by "
        "its first argument, but it is broken. Fix sum.sh so that running sh sum.sh numbers.txt prints 108.",
        [_cmd("sh sum.sh numbers.txt", "108"), _cmd("printf '1\\n2\\n3\\n' > /tmp/n.txt; sh sum.sh /tmp/n.txt", "6")],
        "sed -i 's/total + m/total + n/; s/\\$totl/$total/' sum.sh",
        {"sum.sh": _SUM_SH, "numbers.txt": "4\n8\n15\n16\n23\n42\n"},
    ),
    HardTask(
        "python-fizzbuzz", "train", "python",
        "Write a Python module fizzbuzz.py with a function fizzbuzz(n) that returns Fizz for multiples of 3, "
        "Buzz for multiples of 5, FizzBuzz for multiples of both, and otherwise the number as a string. "
        "python3 test_fizzbuzz.py must pass. Do not change test_fizzbuzz.py.",
        [
            _cmd("python3 test_fizzbuzz.py", "ok"),
            _eq("test_fizzbuzz.py", _FIZZ_TEST, strip=False),
            _cmd("python3 -c 'from fizzbuzz import fizzbuzz; print(fizzbuzz(45), fizzbuzz(9), fizzbuzz(20), fizzbuzz(22))'",
                 "FizzBuzz Fizz Buzz 22"),
        ],
        "cat > fizzbuzz.py <<'EOF'\ndef fizzbuzz(n):\n    if n % 15 == 0:\n        return 'FizzBuzz'\n"
        "    if n % 3 == 0:\n        return 'Fizz'\n    if n % 5 == 0:\n        return 'Buzz'\n    return str(n)\nEOF",
        {"test_fizzbuzz.py": _FIZZ_TEST},
        protected=("test_fizzbuzz.py",),
    ),
    HardTask(
        "fix-median", "train", "debug",
        "The function median in stats.py is wrong for lists of even length. Fix stats.py so that "
        "python3 test_stats.py passes. Do not change test_stats.py.",
        [
            _cmd("python3 test_stats.py", "ok"),
            _eq("test_stats.py", _STATS_TEST, strip=False),
            _cmd("python3 -c 'from stats import median; print(median([5, 1, 9, 3, 7, 100]))'", "6.0"),
        ],
        "python3 - <<'EOF'\nsrc = open('stats.py').read()\nsrc = src.replace('    return ys[mid]\\n', "
        "'    if len(ys) % 2 == 0:\\n        return (ys[mid - 1] + ys[mid]) / 2\\n    return ys[mid]\\n')\n"
        "open('stats.py', 'w').write(src)\nEOF",
        {"stats.py": _STATS_PY, "test_stats.py": _STATS_TEST},
        protected=("test_stats.py",),
    ),
    HardTask(
        "fix-slug-in-repo", "train", "git",
        "The current directory is a git repository. slugify in slug.py should lowercase its text, turn "
        "every run of characters other than letters and digits into a single -, and strip - from both "
        "ends. Fix slug.py so that python3 test_slug.py passes. Do not change test_slug.py.",
        [
            _cmd("python3 test_slug.py", "ok"),
            _eq("test_slug.py", _SLUG_TEST, strip=False),
            _cmd("python3 -c 'from slug import slugify; print(slugify(\"--Top 10 (2024)--\"))'", "top-10-2024"),
        ],
        f"cat > slug.py <<'EOF'\n{_SLUG_FIXED}EOF",
        {"slug.py": _SLUG_PY, "test_slug.py": _SLUG_TEST},
        protected=("test_slug.py",),
        future={"slug.py": _SLUG_FIXED},
    ),
    HardTask(
        "status-report", "train", "text",
        "access.log has one request per line: timestamp, method, path, HTTP status code, bytes. Write "
        "report.txt with one line per distinct status code in the form CODE COUNT (a single space between), "
        "sorted by status code in ascending order.",
        [_eq("report.txt", "200 4\n403 1\n404 2\n500 1\n")],
        "awk '{print $4}' access.log | sort | uniq -c | awk '{print $2, $1}' > report.txt",
        {"access.log": _ACCESS_LOG},
    ),
    HardTask(
        "region-totals", "train", "text",
        "sales.csv has a header line and then lines of region,amount. Write totals.csv with the header "
        "region,total followed by one line per region with the sum of its amounts, sorted by region name.",
        [_eq("totals.csv", "region,total\neast,100\nnorth,200\nsouth,100\nwest,55\n")],
        "{ echo region,total; tail -n +2 sales.csv | awk -F, '{s[$1] += $2} END {for (r in s) print r \",\" s[r]}' "
        "| sort; } > totals.csv",
        {"sales.csv": _SALES},
    ),
    HardTask(
        "active-emails", "train", "python",
        "users.json holds a list of users with the fields name, email and active. Write active_emails.txt "
        "with the email addresses of the active users only, one per line, sorted alphabetically.",
        [_eq("active_emails.txt", "ann@example.com\ncy@example.org\ndee@example.net\n")],
        "python3 -c \"import json; us = json.load(open('users.json')); "
        "print('\\n'.join(sorted(u['email'] for u in us if u['active'])))\" > active_emails.txt",
        {"users.json": _USERS},
    ),
    HardTask(
        "organize-by-extension", "train", "files",
        "Move every file in the current directory into a subdirectory named after its extension without "
        "the dot (for example a.txt goes to txt/a.txt). No files may remain at the top level.",
        [
            *({"kind": "file_exists", "path": f"{p.rsplit('.', 1)[1]}/{p}", "type": "file"} for p in _ORGANIZE),
            _cmd("find . -maxdepth 1 -type f | wc -l", "0"),
        ],
        "for f in *.*; do ext=${f##*.}; mkdir -p \"$ext\"; mv \"$f\" \"$ext/\"; done",
        _ORGANIZE,
    ),
    HardTask(
        "port-check-script", "train", "script",
        "Write an executable shell script check_port.sh that exits with status 0 when its first argument is "
        "a whole number from 1 to 65535 and with status 1 otherwise (including when it is not a number "
        "or is missing).",
        [
            {"kind": "file_mode", "path": "check_port.sh", "executable": True},
            *(_cmd(f"./check_port.sh {a}", exit_code=0) for a in ("1", "80", "65535")),
            *(_cmd(f"./check_port.sh {a}", exit_code=1) for a in ("0", "65536", "abc", "-5", "'8 0'", "")),
        ],
        "cat > check_port.sh <<'EOF'\n#!/bin/sh\ncase \"$1\" in\n  ''|*[!0-9]*) exit 1 ;;\nesac\n"
        "[ \"$1\" -ge 1 ] && [ \"$1\" -le 65535 ] && exit 0\nexit 1\nEOF\nchmod +x check_port.sh",
    ),
    HardTask(
        "top-words", "test", "text",
        "Write top3.txt with the three most frequent words of text.txt, one per line in the form WORD COUNT, "
        "most frequent first. Count words case-insensitively, write them in lowercase, and treat any run of "
        "letters as a word.",
        [_eq("top3.txt", "the 5\ncat 3\ndog 2\n")],
        "tr 'A-Z' 'a-z' < text.txt | tr -cs 'a-z' '\\n' | grep -v '^$' | sort | uniq -c | sort -rn | head -n 3 "
        "| awk '{print $2, $1}' > top3.txt",
        {"text.txt": _TEXT},
    ),
    HardTask(
        "dedupe-in-order", "test", "text",
        "emails.txt contains duplicate lines. Write unique.txt with each distinct line of emails.txt exactly "
        "once, in the order of its first appearance.",
        [_eq("unique.txt", "zoe@x.org\nann@x.org\nbob@x.org\ncy@x.org\n")],
        "awk '!seen[$0]++' emails.txt > unique.txt",
        {"emails.txt": _EMAILS},
    ),
    HardTask(
        "backup-archive", "test", "files",
        "Create a gzip-compressed tar archive named backup.tar.gz that contains the directory project "
        "with all its files, stored under the path project/.",
        [
            _cmd("tar -tzf backup.tar.gz | grep -v '/$' | LC_ALL=C sort",
                 "project/README.md\nproject/lib/util.py\nproject/main.py"),
            _cmd("rm -rf /tmp/x && mkdir /tmp/x && tar -xzf backup.tar.gz -C /tmp/x && diff -r project /tmp/x/project"),
        ],
        "tar -czf backup.tar.gz project",
        _PROJECT,
    ),
    HardTask(
        "python-wordcount-cli", "test", "python",
        "Write a Python program wc.py that reads the file named by its first argument and prints three "
        "numbers separated by single spaces: the number of lines, words and characters of that file.",
        [
            _cmd("python3 wc.py sample.txt", "3 7 34"),
            _cmd("printf 'a b\\n' > /tmp/w.txt; python3 wc.py /tmp/w.txt", "1 2 4"),
        ],
        "cat > wc.py <<'EOF'\nimport sys\n\ntext = open(sys.argv[1]).read()\n"
        "print(text.count('\\n'), len(text.split()), len(text))\nEOF",
        {"sample.txt": "one two three\nfour five\nsix seven\n"},
    ),
]  # fmt: skip
