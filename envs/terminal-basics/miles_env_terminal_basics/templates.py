"""Task templates of terminal-basics, one function per kind of task, grouped by tier.

Each template turns one variant (words, file names, file contents) into a Draft:
an instruction that names the exact file and content and says what to do, never
how; the checks that grade it inside the sandbox; a reference shell solution; and
the starting files. Expected outputs are computed here in Python so the checks
and the starting files can never disagree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Draft", "Template", "TEMPLATES"]


@dataclass(frozen=True, slots=True)
class Draft:
    instruction: str
    checks: list[dict[str, Any]]
    solution: str
    files: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Template:
    name: str
    tier: int
    build: Callable[..., Draft]
    variants: list[tuple[Any, ...]]
    n_test: int  # the last n_test variants go to the test split


def _lines(items: list[str]) -> str:
    return "".join(f"{x}\n" for x in items)


def _eq(path: str, text: str, strip: bool = True) -> dict[str, Any]:
    return {"kind": "file_equals", "path": path, "text": text, "strip": strip}


# ---- tier 1: one command -------------------------------------------------------------


def write_word(word: str, path: str) -> Draft:
    return Draft(
        f"Create a file named {path} containing the word {word}.",
        [_eq(path, word)],
        f"echo {word} > {path}",
    )


def empty_file(path: str) -> Draft:
    return Draft(
        f"Create an empty file named {path}.",
        [{"kind": "file_exists", "path": path, "type": "file"}, _eq(path, "", strip=False)],
        f"touch {path}",
    )


def make_dir(path: str) -> Draft:
    return Draft(
        f"Create a directory named {path}.",
        [{"kind": "file_exists", "path": path, "type": "dir"}],
        f"mkdir {path}",
    )


def copy_file(src: str, dst: str, text: str) -> Draft:
    return Draft(
        f"Copy the file {src} to a new file named {dst}.",
        [_eq(dst, text, strip=False), _eq(src, text, strip=False)],
        f"cp {src} {dst}",
        {src: text},
    )


def rename_file(src: str, dst: str, text: str) -> Draft:
    return Draft(
        f"Rename the file {src} to {dst}.",
        [{"kind": "file_absent", "path": src}, _eq(dst, text, strip=False)],
        f"mv {src} {dst}",
        {src: text},
    )


def delete_file(path: str, keep: str) -> Draft:
    return Draft(
        f"Delete the file {path}. Keep the file {keep}.",
        [{"kind": "file_absent", "path": path}, {"kind": "file_exists", "path": keep, "type": "file"}],
        f"rm {path}",
        {path: "old data\n", keep: "important\n"},
    )


# ---- tier 2: one option or a redirect ------------------------------------------------


def count_lines(src: str, dst: str, items: list[str]) -> Draft:
    return Draft(
        f"Write the number of lines in {src} to a file named {dst}. The file must contain only the number.",
        [_eq(dst, str(len(items)))],
        f"wc -l < {src} > {dst}",
        {src: _lines(items)},
    )


def sort_file(src: str, dst: str, items: list[str]) -> Draft:
    return Draft(
        f"Write the lines of {src} sorted alphabetically to a file named {dst}.",
        [_eq(dst, _lines(sorted(items)))],
        f"sort {src} > {dst}",
        {src: _lines(items)},
    )


def head_lines(src: str, dst: str, n: int, items: list[str]) -> Draft:
    return Draft(
        f"Write the first {n} lines of {src} to a file named {dst}.",
        [_eq(dst, _lines(items[:n]))],
        f"head -n {n} {src} > {dst}",
        {src: _lines(items)},
    )


def make_executable(path: str) -> Draft:
    return Draft(
        f"Make the file {path} executable.",
        [{"kind": "file_mode", "path": path, "executable": True}],
        f"chmod +x {path}",
        {path: "#!/bin/sh\necho ready\n"},
    )


def append_line(path: str, first: str, line: str) -> Draft:
    return Draft(
        f"Add the line {line} at the end of the file {path}, keeping its current content.",
        [_eq(path, f"{first}\n{line}")],
        f"echo {line} >> {path}",
        {path: f"{first}\n"},
    )


def nested_dir(path: str) -> Draft:
    return Draft(
        f"Create the directory {path}, including any missing parent directories.",
        [{"kind": "file_exists", "path": path, "type": "dir"}],
        f"mkdir -p {path}",
    )


# ---- tier 3: pipelines ---------------------------------------------------------------


def count_matches(src: str, dst: str, word: str, items: list[str]) -> Draft:
    n = sum(word in x for x in items)
    return Draft(
        f"Write the number of lines in {src} that contain {word} to a file named {dst}. "
        "The file must contain only the number.",
        [_eq(dst, str(n))],
        f"grep -c {word} {src} > {dst}",
        {src: _lines(items)},
    )


def count_distinct(src: str, dst: str, items: list[str]) -> Draft:
    return Draft(
        f"Write the number of distinct lines in {src} to a file named {dst}. "
        "The file must contain only the number.",
        [_eq(dst, str(len(set(items))))],
        f"sort {src} | uniq | wc -l > {dst}",
        {src: _lines(items)},
    )


def distinct_sorted(src: str, dst: str, items: list[str]) -> Draft:
    return Draft(
        f"Write each distinct line of {src} once, sorted alphabetically, to a file named {dst}.",
        [_eq(dst, _lines(sorted(set(items))))],
        f"sort {src} | uniq > {dst}",
        {src: _lines(items)},
    )


def most_frequent(src: str, dst: str, items: list[str]) -> Draft:
    (top, _), (_, second) = Counter(items).most_common(2)
    assert Counter(items)[top] > second, "variant must have a unique winner"
    return Draft(
        f"Write the line that occurs most often in {src} to a file named {dst}.",
        [_eq(dst, top)],
        f"sort {src} | uniq -c | sort -rn | head -n 1 | awk '{{print $2}}' > {dst}",
        {src: _lines(items)},
    )


def filter_prefix(src: str, dst: str, letter: str, items: list[str]) -> Draft:
    picked = sorted(x for x in items if x.startswith(letter))
    return Draft(
        f"Write the lines of {src} that start with the letter {letter}, sorted alphabetically, "
        f"to a file named {dst}.",
        [_eq(dst, _lines(picked))],
        f"grep '^{letter}' {src} | sort > {dst}",
        {src: _lines(items)},
    )


# ---- tier 4: small scripts -----------------------------------------------------------


def hello_script(path: str, message: str) -> Draft:
    return Draft(
        f"Create an executable shell script named {path} that starts with a shebang line "
        f"and prints exactly {message} when run as ./{path}.",
        [
            {"kind": "file_mode", "path": path, "executable": True},
            {"kind": "file_contains", "path": path, "text": r"\A#!", "regex": True},
            {"kind": "command", "cmd": f"./{path}", "stdout_equals": message},
        ],
        f"printf '#!/bin/sh\\necho \"%s\"\\n' '{message}' > {path}\nchmod +x {path}",
    )


def greet_script(path: str, names: list[str]) -> Draft:
    checks: list[dict[str, Any]] = [{"kind": "file_mode", "path": path, "executable": True}]
    checks += [{"kind": "command", "cmd": f"./{path} {n}", "stdout_equals": f"Hello, {n}!"} for n in names]
    return Draft(
        f"Create an executable shell script named {path} that takes a name as its first argument "
        f"and prints Hello, followed by the name and an exclamation mark (for example ./{path} "
        f"{names[0]} prints Hello, {names[0]}!).",
        checks,
        f"cat > {path} <<'EOF'\n#!/bin/sh\necho \"Hello, $1!\"\nEOF\nchmod +x {path}",
    )


def numbered_files(prefix: str, n: int) -> Draft:
    checks = [_eq(f"{prefix}{i}.txt", str(i)) for i in range(1, n + 1)]
    return Draft(
        f"Create the files {prefix}1.txt through {prefix}{n}.txt, where each file contains its own "
        f"number (for example {prefix}2.txt contains 2).",
        checks,
        f"for i in $(seq 1 {n}); do echo $i > {prefix}$i.txt; done",
    )


def sed_replace(path: str, old: str, new: str, items: list[str]) -> Draft:
    return Draft(
        f"In the file {path}, replace every occurrence of {old} with {new}. Leave everything else unchanged.",
        [_eq(path, _lines([x.replace(old, new) for x in items]), strip=False)],
        f"sed -i 's/{old}/{new}/g' {path}",
        {path: _lines(items)},
    )


def column_sum(src: str, dst: str, rows: list[tuple[str, int]]) -> Draft:
    return Draft(
        f"The file {src} has comma-separated lines of a name and a number. Write the sum of all the "
        f"numbers to a file named {dst}. The file must contain only the number.",
        [_eq(dst, str(sum(n for _, n in rows)))],
        f"awk -F, '{{s += $2}} END {{print s}}' {src} > {dst}",
        {src: _lines([f"{name},{n}" for name, n in rows])},
    )


_FRUIT = ["pear", "apple", "mango", "kiwi", "banana", "cherry", "plum"]
_ANIMALS = ["dog", "cat", "owl", "cat", "fox", "dog", "bee", "cat", "ant"]
_COLORS = ["red", "blue", "red", "green", "blue", "red", "teal", "pink"]
_LOG = ["INFO start", "ERROR disk full", "INFO retry", "WARN slow", "ERROR timeout", "INFO done"]
_LOG2 = ["GET /a 200", "GET /b 404", "POST /a 200", "GET /c 500", "GET /a 200", "PUT /b 200", "GET /d 404"]

TEMPLATES: list[Template] = [
    Template("write-word", 1, write_word, [
        ("hello", "greeting.txt"), ("banana", "fruit.txt"), ("blue", "color.txt"), ("seven", "number.txt"),
        ("ocean", "word.txt"), ("sun", "sky.txt"), ("milk", "drink.txt"), ("apple", "answer.txt"),
        ("river", "name.txt"), ("green", "out.txt"),
    ], n_test=3),
    Template("empty-file", 1, empty_file, [("notes.txt",), ("todo.txt",), ("empty.txt",)], n_test=1),
    Template("make-dir", 1, make_dir, [("reports",), ("data",), ("backup",)], n_test=1),
    Template("copy-file", 1, copy_file, [
        ("source.txt", "backup.txt", "keep me safe\n"), ("notes.txt", "notes_copy.txt", "buy milk\n"),
        ("report.txt", "report_old.txt", "sales were up\n"),
    ], n_test=1),
    Template("rename-file", 1, rename_file, [
        ("draft.txt", "final.txt", "version one\n"), ("old.txt", "new.txt", "some text\n"),
        ("a.txt", "b.txt", "letters\n"),
    ], n_test=1),
    Template("delete-file", 1, delete_file, [("junk.txt", "keep.txt"), ("trash.log", "main.log")], n_test=1),
    Template("count-lines", 2, count_lines, [
        ("data.txt", "count.txt", _FRUIT), ("animals.txt", "lines.txt", _ANIMALS),
        ("colors.txt", "total.txt", _COLORS),
    ], n_test=1),
    Template("sort-file", 2, sort_file, [
        ("names.txt", "sorted.txt", ["zoe", "adam", "mia", "liam", "eva"]), ("fruit.txt", "fruit_sorted.txt", _FRUIT),
    ], n_test=1),
    Template("head-lines", 2, head_lines, [
        ("log.txt", "top.txt", 3, _LOG), ("fruit.txt", "first.txt", 2, _FRUIT),
    ], n_test=0),
    Template("make-executable", 2, make_executable, [("run.sh",), ("build.sh",)], n_test=1),
    Template("append-line", 2, append_line, [
        ("greeting.txt", "hello", "world"), ("list.txt", "eggs", "bread"),
    ], n_test=0),
    Template("nested-dir", 2, nested_dir, [("a/b/c",), ("project/src/lib",)], n_test=0),
    Template("count-matches", 3, count_matches, [
        ("app.log", "errors.txt", "ERROR", _LOG), ("access.log", "notfound.txt", "404", _LOG2),
    ], n_test=1),
    Template("count-distinct", 3, count_distinct, [
        ("colors.txt", "distinct.txt", _COLORS), ("animals.txt", "kinds.txt", _ANIMALS),
    ], n_test=0),
    Template("distinct-sorted", 3, distinct_sorted, [
        ("animals.txt", "unique.txt", _ANIMALS), ("colors.txt", "palette.txt", _COLORS),
    ], n_test=1),
    Template("most-frequent", 3, most_frequent, [
        ("votes.txt", "winner.txt", _COLORS), ("pets.txt", "top.txt", _ANIMALS),
    ], n_test=0),
    Template("filter-prefix", 3, filter_prefix, [
        ("words.txt", "b_words.txt", "b", ["bat", "cow", "bee", "ant", "bison", "cat"]),
        ("fruit.txt", "p_fruit.txt", "p", _FRUIT),
    ], n_test=1),
    Template("hello-script", 4, hello_script, [("hello.sh", "Hello, World!"), ("hi.sh", "Good morning")], n_test=1),
    Template("greet-script", 4, greet_script, [("greet.sh", ["Ada", "Linus"])], n_test=0),
    Template("numbered-files", 4, numbered_files, [("file", 5), ("part", 3)], n_test=1),
    Template("sed-replace", 4, sed_replace, [
        ("config.txt", "debug=false", "debug=true", ["name=app", "debug=false", "port=80", "debug=false"]),
        ("todo.txt", "TODO", "DONE", ["TODO wash car", "DONE shop", "TODO call mom"]),
    ], n_test=0),
    Template("column-sum", 4, column_sum, [
        ("sales.csv", "total.txt", [("ann", 12), ("bob", 30), ("cy", 7)]),
        ("scores.csv", "sum.txt", [("red", 5), ("blue", 11), ("green", 20), ("pink", 4)]),
    ], n_test=1),
]  # fmt: skip
