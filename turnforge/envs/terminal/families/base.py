"""What every family of generated shell tasks is made of: the registry entry (``Family``), what a
family builds for one instance (``Draft``), the checks the verifier runs (``Check``), and the word
pools and workspace helpers the families share.

A family is a function ``build(rng, level) -> Draft``: it draws everything from ``rng`` (so the
same seed gives the same task) and returns the workspace under /app, the instruction, the
reference commands and the checks. Levels: 1, one command on flat paths; 2, nested paths and
more distractor files; 3, two steps or a pipeline.
"""

from __future__ import annotations

import gzip
import io
import random
import tarfile
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence

APP = "/app"

CheckKind = Literal["text", "lines", "dir", "absent", "mode", "tar", "run"]
CHECK_KINDS: tuple[str, ...] = ("text", "lines", "dir", "absent", "mode", "tar", "run")


@dataclass(frozen=True)
class Check:
    """One thing the verifier checks in the final workspace (``generated.CHECK_PY`` runs it):

    - ``text``: the file ``path`` holds ``expected`` (a trailing newline tolerated);
    - ``lines``: the file holds the lines ``expected`` in any order (blank lines ignored);
    - ``dir``: ``path`` is a directory; ``absent``: nothing is at ``path``;
    - ``mode``: ``path``'s permission bits under ``mask`` equal ``expected``;
    - ``tar``: ``path`` is a gzip-compressed tar whose regular files are exactly ``expected``
      ({member name without a leading ./: text});
    - ``run``: running ``path`` with ``args`` (after writing ``inputs``) prints ``expected``.
    """

    kind: CheckKind
    path: str
    expected: Any = None
    mask: int = 0o777  # mode: the bits compared
    args: tuple[str, ...] = ()  # run: the program's arguments
    inputs: tuple[tuple[str, str], ...] = ()  # run: (path, text) files written first

    def __post_init__(self) -> None:
        if self.kind not in CHECK_KINDS:
            raise ValueError(f"check kind {self.kind!r}; valid kinds: {', '.join(CHECK_KINDS)}")


@dataclass(frozen=True)
class Draft:
    """One instance of a family: the workspace, the instruction, the reference commands (one per
    turn) and the checks of the final workspace."""

    files: Mapping[str, str | bytes]  # absolute path under /app -> content (mode 0o644)
    instruction: str
    commands: tuple[str, ...]
    checks: tuple[Check, ...]


@dataclass(frozen=True)
class Family:
    """A registry entry: a family's name, its builder, and whether it is made for the held-out split
    only (its skills recombined, to measure transfer)."""

    name: str
    build: Callable[[random.Random, int], Draft]
    heldout: bool = False

    @property
    def doc(self) -> str:
        """The first line of the builder's docstring: what the family asks."""
        return (self.build.__doc__ or "").strip().splitlines()[0]


# Lowercase ASCII only (every locale sorts them alike); no word contains another, so
# `grep WORD` and `s/WORD/.../g` touch the whole word only.
WORDS = (
    "apple", "river", "stone", "cloud", "tiger", "maple", "piano", "lemon", "ocean", "pixel",
    "robot", "candle", "forest", "garden", "hammer", "island", "jacket", "kettle", "ladder", "magnet",
    "needle", "orange", "pencil", "rabbit", "saddle", "tomato", "violin", "window", "yellow", "zebra",
    "anchor", "bucket", "copper", "dragon", "engine", "falcon", "guitar", "helmet", "insect", "jungle",
)
DIRS = ("data", "docs", "logs", "src", "notes", "reports", "inbox", "archive", "config", "media",
        "backup", "work", "assets", "build", "cache", "drafts", "exports", "queue", "shared", "vault")
EXTS = ("txt", "log", "csv", "md", "py", "json", "cfg")
NAMES = ("alice", "bruno", "chen", "dana", "emil", "fatima", "gus", "hana", "ivan", "jules", "kai", "lena",
         "marco", "nina", "omar", "petra", "quinn", "rosa", "sven", "tara", "umar", "vera", "wes", "yuki", "zoe")
CITIES = ("paris", "tokyo", "lima", "oslo", "cairo", "delhi", "quito", "seoul")
TEAMS = ("red", "blue", "green", "gold")
PEOPLE_HEADER = "name,city,age,team"
ORDINALS = ("first", "second", "third", "fourth")


def phrase(rng: random.Random, n: int = 3, avoid: Sequence[str] = ()) -> str:
    """``n`` random words (none of ``avoid``)."""
    pool = [w for w in WORDS if w not in avoid]
    return " ".join(rng.choice(pool) for _ in range(n))


def distinct_phrases(rng: random.Random, n: int, words: int = 3) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        p = phrase(rng, words)
        if p not in out:
            out.append(p)
    return out


def text_of(lines: Sequence[str]) -> str:
    return "".join(f"{line}\n" for line in lines)


def folder(rng: random.Random, depth: int, avoid: Sequence[str] = ()) -> str:
    """A directory ``depth`` levels under /app, named from ``DIRS`` (none of ``avoid``)."""
    return "/".join([APP, *rng.sample([d for d in DIRS if d not in avoid], depth)])


def noise(rng: random.Random, where: str, stems: Sequence[str], exts: Sequence[str] = ("txt", "md", "log")) -> dict[str, str]:
    """Distractor files ``where/STEM.EXT``, one per stem, holding a line or two of words."""
    return {f"{where}/{s}.{rng.choice(exts)}": text_of([phrase(rng) for _ in range(rng.randint(1, 2))]) for s in stems}


def people(rng: random.Random, n: int) -> list[tuple[str, str, int, str]]:
    """``n`` rows (name, city, age, team) with distinct names."""
    return [(name, rng.choice(CITIES), rng.randint(18, 70), rng.choice(TEAMS)) for name in rng.sample(NAMES, n)]


def csv_text(header: str, rows: Sequence[Sequence[object]], sep: str = ",") -> str:
    return text_of([header] if header else []) + text_of([sep.join(map(str, r)) for r in rows])


def sized(rng: random.Random, size: int) -> str:
    """Text of exactly ``size`` bytes (lines of words)."""
    out = ""
    while len(out) < size:
        out += phrase(rng) + "\n"
    return out[:size]


def tgz(members: Mapping[str, str]) -> bytes:
    """A gzip-compressed tar of ``members`` ({name: text}), byte-identical on every call (fixed
    times and owners)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 1_700_000_000, 0o644
            tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0) as gz:
        gz.write(raw.getvalue())
    return out.getvalue()
