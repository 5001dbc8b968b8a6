"""Families of small scripts: write an executable bash script; the checker runs it."""

from __future__ import annotations

import random

from turnforge.envs.terminal.families.base import APP, WORDS, Check, Draft, Family, noise, phrase, text_of


def bash_script(rng: random.Random, level: int) -> Draft:
    """Write an executable bash script.

    1: it prints a given line; 2: it prints its first argument times K; 3: it prints how many lines of
    the file named by its first argument contain a word. Checked: the checker runs the script (so
    it must be executable, with a #! line) on its own arguments and files and compares what it prints."""
    stem, word, *rest = rng.sample(WORDS, 4)
    path = f"{APP}/{stem}.sh"
    if level == 1:
        line = phrase(rng)
        task, body, checks = f'prints the line "{line}"', f"echo {line}", (Check("run", path, line),)
    elif level == 2:
        k = rng.randint(2, 9)
        task, body = f"prints its first argument (an integer) multiplied by {k}", f"echo $(( $1 * {k} ))"
        checks = tuple(Check("run", path, str(x * k), args=(str(x),)) for x in rng.sample(range(1, 100), 3))
    else:
        task, body = f'prints how many lines of the file named by its first argument contain "{word}"', f'grep -c {word} "$1"'
        inputs = []  # the checker's own files: two counts, so a script that prints a constant fails
        for i, hits in enumerate(rng.sample(range(1, 6), 2)):
            lines = [phrase(rng, 3, avoid=[word]) for _ in range(rng.randint(2, 5))] + [f"{phrase(rng, 2, avoid=[word])} {word}"] * hits
            rng.shuffle(lines)
            inputs.append((f"/tmp/check_{i}.txt", text_of(lines), hits))
        checks = tuple(Check("run", path, str(hits), args=(p,), inputs=((p, t),)) for p, t, hits in inputs)
    return Draft(noise(rng, APP, rest), f"Write an executable bash script {path} that {task}.",
                 (f"printf '#!/bin/bash\\n{body}\\n' > {path}", f"chmod +x {path}"), checks)


FAMILIES = (Family("bash_script", bash_script),)
