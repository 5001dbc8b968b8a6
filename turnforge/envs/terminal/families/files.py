"""Families on files and directories: create, make directories, move, copy, permissions, archives."""

from __future__ import annotations

import random

from turnforge.envs.terminal.families.base import (APP, DIRS, EXTS, WORDS, Check, Draft, Family, folder, noise,
                                                   phrase, text_of)


def write_file(rng: random.Random, level: int) -> Draft:
    """Create a text file with given lines.

    1: one line, in /app; 2: one line, in an existing nested directory; 3: two lines, in a nested
    directory that does not exist yet. Checked: the file's text."""
    stem, other, *rest = rng.sample(WORDS, 5)
    where = APP if level == 1 else folder(rng, 2)
    files = noise(rng, APP, rest)
    if level == 2:
        files[f"{where}/{other}.txt"] = text_of([phrase(rng)])
    path = f"{where}/{stem}.txt"
    lines = [phrase(rng) for _ in range(2 if level == 3 else 1)]
    if level < 3:
        return Draft(files, f'Create the file {path} containing the line "{lines[0]}".',
                     (f"echo '{lines[0]}' > {path}",), (Check("text", path, text_of(lines)),))
    return Draft(files, f'Create the directory {where} and in it the file {path} with two lines: "{lines[0]}", '
                        f'then "{lines[1]}".',
                 (f"mkdir -p {where}", f"printf '{lines[0]}\\n{lines[1]}\\n' > {path}"),
                 (Check("text", path, text_of(lines)),))


def make_dirs(rng: random.Random, level: int) -> Draft:
    """Create directories.

    1: one directory in /app; 2: a directory three levels deep (with its parents); 3: a nested
    directory and an empty file in it. Checked: the directories (and the file) exist."""
    name, *rest = rng.sample(WORDS, 4)
    files = noise(rng, APP, rest)
    if level == 1:
        path = f"{APP}/{name}"
        return Draft(files, f"Create the directory {path}.", (f"mkdir {path}",), (Check("dir", path),))
    path = folder(rng, 3 if level == 2 else 2)
    if level == 2:
        return Draft(files, f"Create the directory {path}, with any missing parent directories.",
                     (f"mkdir -p {path}",), (Check("dir", path),))
    empty = f"{path}/{name}.txt"
    return Draft(files, f"Create the directory {path} (with its parents) and an empty file {empty} in it.",
                 (f"mkdir -p {path}", f"touch {empty}"), (Check("dir", path), Check("text", empty, "")))


def move_file(rng: random.Random, level: int) -> Draft:
    """Move or rename a file.

    1: rename it within /app; 2: move it into another existing directory, keeping its name; 3: move it
    under a new name into a directory that does not exist yet. Checked: the destination holds the
    original text and the source is gone."""
    a, b, c, *rest = rng.sample(WORDS, 6)
    ext = rng.choice(EXTS)
    d1, d2, d3 = rng.sample(DIRS, 3)
    src_dir = APP if level == 1 else f"{APP}/{d1}"
    dst_dir = {1: APP, 2: f"{APP}/{d2}", 3: f"{APP}/{d2}/{d3}"}[level]
    src, dst = f"{src_dir}/{a}.{ext}", f"{dst_dir}/{a if level == 2 else b}.{ext}"
    content = text_of([phrase(rng) for _ in range(3)])
    files = {src: content, **noise(rng, src_dir, rest)}
    commands: tuple[str, ...] = (f"mv {src} {dst}",)
    if level == 1:
        instruction = f"Rename {src} to {dst}."
    elif level == 2:
        files[f"{dst_dir}/{c}.txt"] = text_of([phrase(rng)])
        instruction = f"Move {src} into the directory {dst_dir}, keeping its name."
    else:
        instruction = f"Move {src} to {dst}; create the directory {dst_dir} first."
        commands = (f"mkdir -p {dst_dir}", *commands)
    return Draft(files, instruction, commands, (Check("text", dst, content), Check("absent", src)))


def copy_files(rng: random.Random, level: int) -> Draft:
    """Copy files.

    1: copy a file to a new name in /app; 2: copy a file into another existing directory; 3: copy
    only the .txt files of a directory into a new directory. Checked: the copies hold the original
    text and the originals are still there (3: and no other file was copied)."""
    stems = rng.sample(WORDS, 7)
    d1, d2 = rng.sample(DIRS, 2)
    if level < 3:
        src_dir, ext = (APP if level == 1 else f"{APP}/{d1}"), rng.choice(EXTS)
        dst_dir = APP if level == 1 else f"{APP}/{d2}"
        src, dst = f"{src_dir}/{stems[0]}.{ext}", f"{dst_dir}/{stems[1] if level == 1 else stems[0]}.{ext}"
        content = text_of([phrase(rng) for _ in range(3)])
        files = {src: content, **noise(rng, src_dir, stems[2:4])}
        if level == 1:
            instruction, commands = f"Copy {src} to {dst}.", (f"cp {src} {dst}",)
        else:
            files[f"{dst_dir}/{stems[4]}.txt"] = text_of([phrase(rng)])
            instruction, commands = f"Copy {src} into the directory {dst_dir}, keeping its name.", (f"cp {src} {dst_dir}/",)
        return Draft(files, instruction, commands, (Check("text", dst, content), Check("text", src, content)))
    src_dir, dst_dir = f"{APP}/{d1}", f"{APP}/{d2}"
    n_txt = rng.randint(2, 3)
    texts = {f"{src_dir}/{s}.txt": text_of([phrase(rng)]) for s in stems[:n_txt]}
    others = noise(rng, src_dir, stems[n_txt:n_txt + 2], exts=("md", "log", "csv"))
    checks = [Check("text", f"{dst_dir}/{p.rsplit('/', 1)[1]}", t) for p, t in texts.items()]
    checks += [Check("absent", f"{dst_dir}/{p.rsplit('/', 1)[1]}") for p in others]
    checks += [Check("text", p, t) for p, t in texts.items()]
    return Draft({**texts, **others}, f"Copy every .txt file of {src_dir} (and no other file) into a new directory {dst_dir}.",
                 (f"mkdir -p {dst_dir}", f"cp {src_dir}/*.txt {dst_dir}/"), tuple(checks))


MODES = (0o600, 0o640, 0o400, 0o444, 0o700, 0o750, 0o755, 0o660)


def chmod(rng: random.Random, level: int) -> Draft:
    """Change permissions.

    1: make a script executable; 2: set a file's mode to a given octal number; 3: make every .sh file
    of a directory executable. Checked: the permission bits (the owner's execute bit for
    'executable', all nine bits for an octal mode)."""
    stems = rng.sample(WORDS, 6)
    where = APP if level == 1 else folder(rng, 1)
    files = noise(rng, where, stems[3:])

    def script(stem: str) -> str:
        return f"#!/bin/bash\necho {stem}\n"

    if level == 1:
        path = f"{where}/{stems[0]}.sh"
        files[path] = script(stems[0])
        return Draft(files, f"Make {path} executable.", (f"chmod +x {path}",), (Check("mode", path, 0o100, mask=0o100),))
    if level == 2:
        path, mode = f"{where}/{stems[0]}.{rng.choice(('key', 'pem', 'cfg'))}", rng.choice(MODES)
        files[path] = text_of([phrase(rng)])
        return Draft(files, f"Set the permissions of {path} to {mode:o} (octal).", (f"chmod {mode:o} {path}",),
                     (Check("mode", path, mode),))
    scripts = [f"{where}/{s}.sh" for s in stems[:rng.randint(2, 3)]]
    files.update({p: script(p.rsplit("/", 1)[1][:-3]) for p in scripts})
    return Draft(files, f"Make every .sh file in {where} executable.", (f"chmod +x {where}/*.sh",),
                 tuple(Check("mode", p, 0o100, mask=0o100) for p in scripts))


def tar_create(rng: random.Random, level: int) -> Draft:
    """Create a gzip-compressed tar archive.

    1: of a directory of /app; 2: of a nested directory with subdirectories; 3: of two directories,
    into a directory that does not exist yet. Checked: the archive's regular files, by member name
    (the names the instruction gives) and text, and nothing else."""
    d1, d2, d3, sub = rng.sample(DIRS, 4)
    stems = rng.sample(WORDS, 8)
    files = noise(rng, APP, stems[6:])

    def tree(parent: str, name: str, stems: list[str], nested: bool) -> dict[str, str]:
        paths = [f"{name}/{s}.{rng.choice(EXTS)}" for s in stems]
        if nested:
            paths[-1] = f"{name}/{sub}/{stems[-1]}.txt"
        members = {p: text_of([phrase(rng)]) for p in paths}
        files.update({f"{parent}/{p}": t for p, t in members.items()})
        return members

    if level == 1:
        members, archive = tree(APP, d1, stems[:3], False), f"{APP}/{d1}.tar.gz"
        return Draft(files, f"Create the gzip-compressed tar archive {archive} of the directory {APP}/{d1} (member "
                            f"paths start with {d1}/).", (f"tar -czf {archive} -C {APP} {d1}",), (Check("tar", archive, members),))
    if level == 2:
        parent, archive = f"{APP}/{d1}", f"{APP}/{d2}.tar.gz"
        members = tree(parent, d2, stems[:4], True)
        files.update(noise(rng, parent, stems[4:6]))  # next to the directory, not in it
        return Draft(files, f"Create the gzip-compressed tar archive {archive} of the directory {parent}/{d2} (member "
                            f"paths start with {d2}/).", (f"tar -czf {archive} -C {parent} {d2}",), (Check("tar", archive, members),))
    members = {**tree(APP, d1, stems[:3], False), **tree(APP, d2, stems[3:6], True)}
    archive = f"{APP}/{d3}/bundle.tar.gz"
    return Draft(files, f"Create the directory {APP}/{d3} and in it the gzip-compressed tar archive {archive} of the "
                        f"directories {APP}/{d1} and {APP}/{d2} (member paths start with {d1}/ and {d2}/).",
                 (f"mkdir -p {APP}/{d3}", f"tar -czf {archive} -C {APP} {d1} {d2}"), (Check("tar", archive, members),))


FAMILIES = (Family("write_file", write_file), Family("make_dirs", make_dirs), Family("move_file", move_file),
            Family("copy_files", copy_files), Family("chmod", chmod), Family("tar_create", tar_create))
