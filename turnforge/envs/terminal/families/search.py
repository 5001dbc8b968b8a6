"""Families of finding files by a predicate: extension, name pattern, size."""

from __future__ import annotations

import random

from turnforge.envs.terminal.families.base import APP, DIRS, EXTS, WORDS, Check, Draft, Family, phrase, sized, text_of

PREFIXES = ("test", "old", "tmp", "draft", "final", "copy")


def _places(rng: random.Random, root: str, nested: bool) -> list[str]:
    """Directories to spread files over: ``root`` alone, or ``root`` and directories below it, the
    deepest last (the families put one wanted file there, so a search that does not recurse fails)."""
    if not nested:
        return [root]
    a, b, c = rng.sample(DIRS, 3)
    return [root, f"{root}/{c}", f"{root}/{a}", f"{root}/{a}/{b}"]


def find_ext(rng: random.Random, level: int) -> Draft:
    """List the files of a directory tree with a given extension (3: and a given name prefix).

    1: a flat directory; 2: a nested tree, with matching files outside it too; 3: names like
    PREFIX_*.EXT among near misses. Checked: the output file's lines, in any order."""
    root_name, other = rng.sample(DIRS, 2)
    root, out = f"{APP}/{root_name}", f"{APP}/{rng.choice(('found', 'matches', 'list'))}.txt"
    places = _places(rng, root, level > 1)
    ext, *others = rng.sample(EXTS, 3)
    prefix, other_prefix = rng.sample(PREFIXES, 2)
    stems = iter(rng.sample(WORDS, 14))
    if level < 3:
        want = [f"{places[-1] if i == 0 else rng.choice(places)}/{next(stems)}.{ext}" for i in range(rng.randint(2, 4))]
        misses = [f"{rng.choice(places)}/{next(stems)}.{rng.choice(others)}" for _ in range(rng.randint(3, 5))]
    else:
        want = [f"{places[-1] if i == 0 else rng.choice(places)}/{prefix}_{next(stems)}.{ext}" for i in range(rng.randint(2, 3))]
        misses = [f"{rng.choice(places)}/{name}" for name in (
            f"{prefix}_{next(stems)}.{others[0]}", f"{next(stems)}_{prefix}.{ext}", f"{other_prefix}_{next(stems)}.{ext}",
            f"{next(stems)}.{ext}")]
    if level == 2:
        misses.append(f"{APP}/{other}/{next(stems)}.{ext}")  # the right extension, outside the tree
    files = {p: text_of([phrase(rng)]) for p in want + misses}
    pattern = f"*.{ext}" if level < 3 else f"{prefix}_*.{ext}"
    what = f"all .{ext} files" if level < 3 else f"all files whose names start with {prefix}_ and end with .{ext}"
    scope = f"in {root}" if level == 1 else f"under {root} (in any subdirectory)"
    return Draft(files, f"Write the absolute paths of {what} {scope} to {out}, one per line, in any order.",
                 (f"find {root} -name '{pattern}' > {out}",), (Check("lines", out, sorted(want)),))


def find_size(rng: random.Random, level: int) -> Draft:
    """List the files of a directory tree by size in bytes.

    1: larger than N, flat directory; 2: larger than N, nested tree; 3: between two sizes.
    Checked: the output file's lines, in any order."""
    root, out = f"{APP}/{rng.choice(DIRS)}", f"{APP}/{rng.choice(('big', 'sizes', 'selected'))}.txt"
    places = _places(rng, root, level > 1)
    low, high = (rng.choice((500, 1000, 1500)), None) if level < 3 else (rng.choice((200, 400)), rng.choice((1200, 1600)))
    bands = [(10, low - 50), (low + 50, 3000)] if high is None else [(10, low - 50), (low + 50, high - 50), (high + 50, 3000)]
    n_in, n_out = rng.randint(2, 3), rng.randint(3, 4)
    sizes = {}
    for stem in rng.sample(WORDS, n_in + n_out):
        inside = len(sizes) < n_in
        band = bands[1] if inside else rng.choice([b for i, b in enumerate(bands) if i != 1])
        where = places[-1] if not sizes else rng.choice(places)  # one wanted file in the deepest directory
        sizes[f"{where}/{stem}.{rng.choice(EXTS)}"] = (rng.randint(*band), inside)
    files = {p: sized(rng, size) for p, (size, _) in sizes.items()}
    want = sorted(p for p, (_, inside) in sizes.items() if inside)
    scope = f"in {root}" if level == 1 else f"under {root} (in any subdirectory)"
    if high is None:
        return Draft(files, f"Write the absolute paths of the files {scope} larger than {low} bytes to {out}, one per line, "
                            "in any order.", (f"find {root} -type f -size +{low}c > {out}",), (Check("lines", out, want),))
    return Draft(files, f"Write the absolute paths of the files {scope} larger than {low} bytes and smaller than {high} "
                        f"bytes to {out}, one per line, in any order.",
                 (f"find {root} -type f -size +{low}c -size -{high}c > {out}",), (Check("lines", out, want),))


FAMILIES = (Family("find_ext", find_ext), Family("find_size", find_size))
