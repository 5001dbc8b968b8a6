"""Families of text processing: grep, sed, sort/uniq, cut, head/tail."""

from __future__ import annotations

import random
from collections import Counter

from turnforge.envs.terminal.families.base import (APP, ORDINALS, PEOPLE_HEADER, WORDS, Check, Draft, Family, csv_text,
                                                   distinct_phrases, folder, noise, people, phrase, text_of)

TAGS = ("INFO", "WARN", "ERROR", "DEBUG")


def log_lines(rng: random.Random, tag: str, n: int, hits: int, word: str | None = None) -> list[str]:
    """``n`` log lines, ``hits`` of them tagged ``tag``. With ``word``: ``hits`` lines hold both,
    and at least one holds only the tag and one only the word (so neither grep alone is right)."""
    others = [t for t in TAGS if t != tag]
    tags = [tag] * hits + [rng.choice(others) for _ in range(n - hits)]
    has_word = [False] * n
    if word is not None:
        tags = [tag] * (hits + 1) + [rng.choice(others) for _ in range(n - hits - 1)]
        has_word = [True] * hits + [False] + [True] + [rng.random() < 0.3 for _ in range(n - hits - 2)]
    order = list(range(n))
    rng.shuffle(order)
    lines = []
    for i in order:
        message = phrase(rng, 3, avoid=[word] if word else ())
        if has_word[i]:
            message = f"{message} {word}"
        lines.append(f"{tags[i]} {message}")
    return lines


def count_matches(rng: random.Random, level: int) -> Draft:
    """Count the lines of a log that contain a tag (3: a tag and a word) and write the number to a file.

    1: a log in /app; 2: a log among other logs in a nested directory; 3: lines with both a tag and a
    word (a grep pipeline). Checked: the number in the answer file."""
    tag, word = rng.choice(TAGS), rng.choice(WORDS)
    n = 10 if level == 1 else 24
    hits = rng.randint(2, n // 2)
    where = APP if level == 1 else folder(rng, 2)
    path, out = f"{where}/app.log", f"{APP}/{rng.choice(('count', 'answer', 'result'))}.txt"
    files = {path: text_of(log_lines(rng, tag, n, hits, word if level == 3 else None))}
    if level > 1:
        files.update({f"{where}/{s}.log": text_of(log_lines(rng, tag, 6, 3)) for s in rng.sample(WORDS, 2)})
    if level < 3:
        return Draft(files, f"Count the lines of {path} that contain {tag} and write the number to {out}.",
                     (f"grep -c {tag} {path} > {out}",), (Check("text", out, str(hits)),))
    return Draft(files, f"Count the lines of {path} that contain both {tag} and {word}, and write the number to {out}.",
                 (f"grep {tag} {path} | grep -c {word} > {out}",), (Check("text", out, str(hits)),))


def replace_word(rng: random.Random, level: int) -> Draft:
    """Replace every occurrence of a word by another, editing in place.

    1: one file in /app; 2: a longer file in a nested directory; 3: every .txt file of a directory.
    Checked: each file's text after the replacement."""
    old, new, *stems = rng.sample(WORDS, 6)
    where = APP if level == 1 else folder(rng, 1 if level == 3 else 2)
    paths = [f"{where}/{s}.txt" for s in stems[:1 if level < 3 else rng.randint(2, 3)]]
    files = noise(rng, APP if level == 1 else folder(rng, 1, avoid=[where.split("/")[2]]), stems[3:], exts=("md", "log"))
    checks = []
    for path in paths:
        lines = [phrase(rng, rng.randint(3, 5), avoid=[old]).split() for _ in range(4 if level == 1 else 8)]
        i, j = rng.sample(range(len(lines)), 2)  # two lines hold it, one of them twice
        lines[i].insert(rng.randint(0, len(lines[i])), old)
        lines[j] = [old, *lines[j], old]
        text = text_of([" ".join(ws) for ws in lines])
        files[path] = text
        checks.append(Check("text", path, text.replace(old, new)))
    target = paths[0] if level < 3 else f"{where}/*.txt"
    where_text = paths[0] if level < 3 else f"every .txt file of {where}"
    return Draft(files, f'In {where_text}, replace every occurrence of the word "{old}" with "{new}" (edit in place).',
                 (f"sed -i 's/{old}/{new}/g' {target}",), tuple(checks))


def sort_unique(rng: random.Random, level: int) -> Draft:
    """Sort the distinct lines of a file (3: find its most frequent line).

    1: a short word list in /app; 2: a longer one in a nested directory; 3: the word that appears most
    often (sort | uniq -c | sort -rn pipeline). Checked: the output file's text."""
    where = APP if level == 1 else folder(rng, 2)
    stem, out_stem = rng.sample(WORDS, 2)
    path, out = f"{where}/{stem}.txt", f"{APP}/{out_stem}.txt"
    vocab = rng.sample(WORDS, 5 if level == 1 else 8)
    if level < 3:
        lines = [rng.choice(vocab) for _ in range(10 if level == 1 else 25)]  # more lines than words: repeats
        rng.shuffle(lines)
        return Draft({path: text_of(lines)}, f"Write the distinct lines of {path}, sorted alphabetically, to {out}.",
                     (f"sort -u {path} > {out}",), (Check("text", out, text_of(sorted(set(lines)))),))
    counts = rng.sample(range(1, 8), len(vocab) - 1)
    top = max(counts) + rng.randint(1, 2)
    lines = [w for w, c in zip(vocab, [top, *counts]) for _ in range(c)]
    rng.shuffle(lines)
    assert Counter(lines).most_common(2)[1][1] < top
    return Draft({path: text_of(lines)}, f"{path} has one word per line. Write the word that appears most often to {out}.",
                 (f"sort {path} | uniq -c | sort -rn | head -n 1 | awk '{{print $2}}' > {out}",), (Check("text", out, vocab[0]),))


def extract_column(rng: random.Random, level: int) -> Draft:
    """Extract one column of a table.

    1: a field of a ':'-separated file in /app; 2: a named column of a CSV with a header, without the
    header; 3: the distinct values of a column, sorted. Checked: the output file's text (in order)."""
    rows = people(rng, rng.randint(6, 9) if level == 1 else rng.randint(10, 14))
    stem = rng.choice(WORDS)
    out = f"{APP}/{rng.choice(('column', 'values', 'out'))}.txt"
    if level == 1:
        path, k = f"{APP}/{stem}.txt", rng.randint(1, 4)
        return Draft({path: csv_text("", rows, ":")}, f'{path} has one record per line, fields separated by ":". Write the '
                                                      f"{ORDINALS[k - 1]} field of every line to {out}, one per line.",
                     (f"cut -d: -f{k} {path} > {out}",), (Check("text", out, text_of([str(r[k - 1]) for r in rows])),))
    path = f"{folder(rng, 1)}/{stem}.csv"
    header = PEOPLE_HEADER.split(",")
    k = rng.randint(1, 4) if level == 2 else rng.choice((2, 4))  # 3: a column with repeats
    head = f'{path} is a CSV file whose first line is the header "{PEOPLE_HEADER}".'
    values = [str(r[k - 1]) for r in rows]
    if level == 2:
        return Draft({path: csv_text(PEOPLE_HEADER, rows)}, f'{head} Write its "{header[k - 1]}" column to {out}, one value '
                                                           "per line, without the header.",
                     (f"tail -n +2 {path} | cut -d, -f{k} > {out}",), (Check("text", out, text_of(values)),))
    return Draft({path: csv_text(PEOPLE_HEADER, rows)}, f'{head} Write the distinct values of its "{header[k - 1]}" column, '
                                                       f"sorted alphabetically, to {out}, one per line.",
                 (f"tail -n +2 {path} | cut -d, -f{k} | sort -u > {out}",), (Check("text", out, text_of(sorted(set(values)))),))


def head_tail(rng: random.Random, level: int) -> Draft:
    """Write some lines of a file to another.

    1: the first N lines; 2: the last N lines of a file in a nested directory; 3: lines A to B.
    Checked: the output file's text."""
    lines = distinct_phrases(rng, rng.randint(10, 16))
    where = APP if level == 1 else folder(rng, 2)
    stem, out_stem = rng.sample(WORDS, 2)
    path, out = f"{where}/{stem}.txt", f"{APP}/{out_stem}.txt"
    files = {path: text_of(lines)}
    n = rng.randint(2, 6)
    if level == 1:
        return Draft(files, f"Write the first {n} lines of {path} to {out}.", (f"head -n {n} {path} > {out}",),
                     (Check("text", out, text_of(lines[:n])),))
    if level == 2:
        return Draft(files, f"Write the last {n} lines of {path} to {out}.", (f"tail -n {n} {path} > {out}",),
                     (Check("text", out, text_of(lines[-n:])),))
    a = rng.randint(2, len(lines) - n)
    b = a + n - 1
    return Draft(files, f"Write lines {a} to {b} of {path} (counting from 1, both included) to {out}.",
                 (f"sed -n '{a},{b}p' {path} > {out}",), (Check("text", out, text_of(lines[a - 1:b])),))


FAMILIES = (Family("count_matches", count_matches), Family("replace_word", replace_word),
            Family("sort_unique", sort_unique), Family("extract_column", extract_column), Family("head_tail", head_tail))
