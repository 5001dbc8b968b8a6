"""Held-out families: the train families' skills in new combinations. They never appear in the
train split, so success on them measures transfer rather than recall."""

from __future__ import annotations

import random
from pathlib import PurePosixPath

from turnforge.envs.terminal.families.base import (APP, DIRS, EXTS, PEOPLE_HEADER, WORDS, Check, Draft, Family, csv_text,
                                                   folder, noise, people, phrase, sized, text_of, tgz)
from turnforge.envs.terminal.families.text import TAGS, log_lines


def archive_count(rng: random.Random, level: int) -> Draft:
    """Extract a tar.gz archive, then count lines in what it held.

    1: all lines of one file; 2: the lines of one file that contain a tag; 3: the lines of all its .log
    files that contain a tag. Checked: the number in the answer file (not the extraction itself)."""
    name, out = rng.choice(DIRS), f"{APP}/{rng.choice(('count', 'answer', 'lines'))}.txt"
    tag = rng.choice(TAGS)
    stems = rng.sample(WORDS, 4)
    logs = {f"{name}/{s}.log": log_lines(rng, tag, rng.randint(6, 12), rng.randint(1, 4)) for s in stems[:3]}
    members = {p: text_of(lines) for p, lines in logs.items()}
    members[f"{name}/{stems[3]}.md"] = text_of([f"{phrase(rng)} {tag}"])  # holds the tag, not a .log
    archive = f"{APP}/{name}.tar.gz"
    target = next(iter(logs))
    extract = f"tar -xzf {archive} -C {APP}"
    say = f"Extract {archive} in {APP}, then write"
    if level == 1:
        return Draft({archive: tgz(members)}, f"{say} the number of lines of {APP}/{target} to {out}.",
                     (extract, f"wc -l < {APP}/{target} > {out}"), (Check("text", out, str(len(logs[target]))),))
    if level == 2:
        hits = sum(tag in line for line in logs[target])
        return Draft({archive: tgz(members)}, f"{say} the number of lines of {APP}/{target} that contain {tag} to {out}.",
                     (extract, f"grep -c {tag} {APP}/{target} > {out}"), (Check("text", out, str(hits)),))
    hits = sum(tag in line for lines in logs.values() for line in lines)
    return Draft({archive: tgz(members)}, f"{say} the total number of lines containing {tag} in the .log files of "
                                          f"{APP}/{name} to {out}.",
                 (extract, f"cat {APP}/{name}/*.log | grep -c {tag} > {out}"), (Check("text", out, str(hits)),))


def filter_count(rng: random.Random, level: int) -> Draft:
    """Count the rows of a CSV file that pass a filter.

    1: city is X; 2: age above N; 3: city is X and age above N. Checked: the number in the answer file."""
    rows = people(rng, rng.randint(10, 16))
    path = f"{APP if level == 1 else folder(rng, 1)}/{rng.choice(WORDS)}.csv"
    out = f"{APP}/{rng.choice(('count', 'answer', 'rows'))}.txt"
    ages = sorted(r[2] for r in rows)
    age = rng.randint(ages[0], ages[-1] - 1)  # at least one row above it, one not
    city = max(rows, key=lambda r: r[2])[1] if level == 3 else rng.choice(rows)[1]  # 3: the oldest row passes both
    cond, test, text = {
        1: (f'$2 == "{city}"', lambda r: r[1] == city, f'whose city is "{city}"'),
        2: (f"NR > 1 && $3 > {age}", lambda r: r[2] > age, f"whose age is greater than {age}"),
        3: (f'$2 == "{city}" && $3 > {age}', lambda r: r[1] == city and r[2] > age,
            f'whose city is "{city}" and whose age is greater than {age}'),
    }[level]
    return Draft({path: csv_text(PEOPLE_HEADER, rows)},
                 f'{path} is a CSV file whose first line is the header "{PEOPLE_HEADER}". Write the number of rows {text} '
                 f"to {out}.", (f"awk -F, '{cond}' {path} | wc -l > {out}",), (Check("text", out, str(sum(map(test, rows)))),))


def delete_empty(rng: random.Random, level: int) -> Draft:
    """Delete the empty files of a directory tree and keep the others.

    1: a flat directory; 2: a nested tree; 3: a nested tree, also removing the directories left empty.
    Checked: the empty files (3: and every directory holding only empty files) are gone; every other
    file is unchanged."""
    root = f"{APP}/{rng.choice(DIRS)}"
    a, b, c, d = rng.sample(DIRS, 4)
    places = [root] if level == 1 else [root, f"{root}/{a}", f"{root}/{a}/{b}"]
    stems = iter(rng.sample(WORDS, 12))
    kept = {f"{root}/{next(stems)}.txt": text_of([phrase(rng)])}  # so the root never empties
    kept.update({f"{rng.choice(places)}/{next(stems)}.{rng.choice(EXTS)}": text_of([phrase(rng)]) for _ in range(rng.randint(2, 3))})
    empty = [f"{rng.choice(places)}/{next(stems)}.{rng.choice(EXTS)}" for _ in range(rng.randint(2, 4))]
    if level > 1:  # directories that hold only empty files
        empty += [f"{root}/{c}/{next(stems)}.log", f"{root}/{d}/{b}/{next(stems)}.tmp"]
    files: dict[str, str] = {**kept, **dict.fromkeys(empty, "")}
    checks = [Check("absent", p) for p in empty] + [Check("text", p, t) for p, t in kept.items()]
    if level < 3:
        return Draft(files, f"Delete every empty file {'in' if level == 1 else 'under'} {root}; keep the other files.",
                     (f"find {root} -type f -empty -delete",), tuple(checks))
    dirs = {str(parent) for p in files for parent in PurePosixPath(p).parents if parent.is_relative_to(root)} - {root}
    emptied = sorted(x for x in dirs if not any(PurePosixPath(k).is_relative_to(x) for k in kept))
    return Draft(files, f"Delete every empty file under {root}, then every directory under it left empty; keep the other "
                        "files.", (f"find {root} -mindepth 1 -empty -delete",), (*checks, *(Check("absent", x) for x in emptied)))


def largest_file(rng: random.Random, level: int) -> Draft:
    """Find the largest files of a directory.

    1: the name of the largest file of a flat directory; 2: the names of the three largest, largest
    first; 3: the absolute path of the largest file of a nested tree. Checked: the answer file's text."""
    root = f"{APP}/{rng.choice(DIRS)}"
    places = [root] if level < 3 else [root, *(f"{root}/{d}" for d in rng.sample(DIRS, 2))]
    sizes = rng.sample(range(20, 4000, 7), rng.randint(5, 8))  # distinct sizes
    *stems, other = rng.sample(WORDS, len(sizes) + 1)
    top = max(sizes)  # 3: in a subdirectory, so a search that does not recurse fails
    paths = [f"{places[-1] if size == top else rng.choice(places)}/{s}.{rng.choice(EXTS)}" for s, size in zip(stems, sizes)]
    files = {p: sized(rng, size) for p, size in zip(paths, sizes)}
    by_size = [p for _, p in sorted(zip(sizes, paths), reverse=True)]
    out = f"{APP}/{rng.choice(('largest', 'biggest', 'top'))}.txt"
    files.update(noise(rng, APP, [other]))  # outside the directory
    if level == 1:
        return Draft(files, f"Write the name (not the path) of the largest file in {root} to {out}.",
                     (f"ls -S {root} | head -n 1 > {out}",), (Check("text", out, by_size[0].rsplit("/", 1)[1]),))
    if level == 2:
        return Draft(files, f"Write the names (not the paths) of the three largest files in {root}, largest first, to "
                            f"{out}, one per line.", (f"ls -S {root} | head -n 3 > {out}",),
                     (Check("text", out, text_of([p.rsplit("/", 1)[1] for p in by_size[:3]])),))
    return Draft(files, f"Write the absolute path of the largest file under {root} (in any subdirectory) to {out}.",
                 (f"find {root} -type f -printf '%s %p\\n' | sort -n | tail -n 1 | cut -d' ' -f2 > {out}",),
                 (Check("text", out, by_size[0]),))


def grep_files(rng: random.Random, level: int) -> Draft:
    """Find the files that contain a word.

    1: the paths of such files in a flat directory; 2: in a nested tree; 3: how many files of a nested
    tree contain it. Checked: the output file's lines in any order (3: the number)."""
    root = f"{APP}/{rng.choice(DIRS)}"
    places = [root] if level == 1 else [root, *(f"{root}/{d}" for d in rng.sample(DIRS, 2))]
    word, *stems = rng.sample(WORDS, 10)
    paths = [f"{places[-1] if i == 0 else rng.choice(places)}/{s}.{rng.choice(EXTS)}" for i, s in enumerate(stems[:rng.randint(5, 9)])]
    hits = sorted([paths[0], *rng.sample(paths[1:], rng.randint(1, len(paths) - 3))])  # paths[0]: the deepest directory
    files = {p: text_of([phrase(rng, 3, avoid=[word]) for _ in range(rng.randint(1, 3))]) for p in paths}
    for p in hits:
        files[p] += f"{phrase(rng, 2, avoid=[word])} {word}\n"
    out = f"{APP}/{rng.choice(('hits', 'matches', 'found'))}.txt"
    scope = f"in {root}" if level == 1 else f"under {root} (in any subdirectory)"
    if level < 3:
        return Draft(files, f'Write the absolute paths of the files {scope} that contain the word "{word}" to {out}, one per '
                            "line, in any order.", (f"grep -rl {word} {root} > {out}",), (Check("lines", out, hits),))
    return Draft(files, f'Write the number of files {scope} that contain the word "{word}" to {out}.',
                 (f"grep -rl {word} {root} | wc -l > {out}",), (Check("text", out, str(len(hits))),))


FAMILIES = (Family("archive_count", archive_count, heldout=True), Family("filter_count", filter_count, heldout=True),
            Family("delete_empty", delete_empty, heldout=True), Family("largest_file", largest_file, heldout=True),
            Family("grep_files", grep_files, heldout=True))
