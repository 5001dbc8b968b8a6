"""Families of CSV and JSON wrangling, with awk (Debian's mawk) and python3's json module (no jq)."""

from __future__ import annotations

import json
import random

from turnforge.envs.terminal.families.base import (APP, CITIES, NAMES, PEOPLE_HEADER, TEAMS, WORDS, Check, Draft, Family,
                                                   csv_text, folder, people, text_of)

SALES_HEADER = "id,item,region,qty,price"
REGIONS = ("north", "south", "east", "west")


def csv_sum(rng: random.Random, level: int) -> Draft:
    """Sum numbers and write the total to a file.

    1: a file of one integer per line; 2: a named column of a CSV with a header; 3: that column over
    the rows of one region only. Checked: the total in the answer file."""
    out = f"{APP}/{rng.choice(('total', 'sum', 'answer'))}.txt"
    if level == 1:
        path, numbers = f"{APP}/{rng.choice(WORDS)}.txt", [rng.randint(1, 500) for _ in range(rng.randint(5, 10))]
        return Draft({path: text_of([str(x) for x in numbers])}, f"Write the sum of the numbers in {path} (one per line) to {out}.",
                     (f"awk '{{s += $1}} END {{print s}}' {path} > {out}",), (Check("text", out, str(sum(numbers))),))
    path = f"{folder(rng, 1)}/sales.csv"
    rows = [(i, rng.choice(WORDS), rng.choice(REGIONS), rng.randint(1, 20), rng.randint(1, 500)) for i in range(1, rng.randint(8, 14))]
    region = rows[0][2]
    k = rng.choice((4, 5))
    column = SALES_HEADER.split(",")[k - 1]
    head = f'{path} is a CSV file whose first line is the header "{SALES_HEADER}".'
    files = {path: csv_text(SALES_HEADER, rows)}
    if level == 2:
        return Draft(files, f'{head} Write the sum of its "{column}" column to {out}.',
                     (f"awk -F, 'NR > 1 {{s += ${k}}} END {{print s}}' {path} > {out}",),
                     (Check("text", out, str(sum(r[k - 1] for r in rows))),))
    return Draft(files, f'{head} Write the sum of "{column}" over the rows whose region is "{region}" to {out}.',
                 (f"awk -F, '$3 == \"{region}\" {{s += ${k}}} END {{print s}}' {path} > {out}",),
                 (Check("text", out, str(sum(r[k - 1] for r in rows if r[2] == region))),))


def csv_filter(rng: random.Random, level: int) -> Draft:
    """Filter the rows of a CSV file.

    1: rows whose city is X; 2: rows whose age is above N; 3: the names of one team's rows, sorted
    (filter then sort). Checked: the output file's text."""
    rows = people(rng, rng.randint(8, 14))
    path = f"{APP if level == 1 else folder(rng, 1)}/{rng.choice(WORDS)}.csv"
    out = f"{APP}/{rng.choice(('selected', 'filtered', 'rows'))}.{'txt' if level == 3 else 'csv'}"
    files = {path: csv_text(PEOPLE_HEADER, rows)}
    head = f'{path} is a CSV file whose first line is the header "{PEOPLE_HEADER}".'
    if level == 1:
        city = rows[0][1]
        return Draft(files, f'{head} Write the rows whose city is "{city}" to {out}, in their order, without the header.',
                     (f"awk -F, '$2 == \"{city}\"' {path} > {out}",),
                     (Check("text", out, csv_text("", [r for r in rows if r[1] == city])),))
    if level == 2:
        ages = sorted(r[2] for r in rows)
        age = rng.randint(ages[0], ages[-1] - 1)
        return Draft(files, f"{head} Write the rows whose age is greater than {age} to {out}, in their order, without the "
                            "header.", (f"awk -F, 'NR > 1 && $3 > {age}' {path} > {out}",),
                     (Check("text", out, csv_text("", [r for r in rows if r[2] > age])),))
    team = rows[0][3]
    return Draft(files, f'{head} Write the names of the rows whose team is "{team}", sorted alphabetically, to {out}, one '
                        "per line.", (f"awk -F, '$4 == \"{team}\" {{print $1}}' {path} | sort > {out}",),
                 (Check("text", out, text_of(sorted(r[0] for r in rows if r[3] == team))),))


def json_field(rng: random.Random, level: int) -> Draft:
    """Read a JSON file.

    1: a top-level field; 2: a field of a nested object; 3: the number of list items with a flag set.
    Checked: the value in the answer file. The reference uses python3's json module (jq may be
    missing), or for 3, grep on the indented file."""
    out = f"{APP}/{rng.choice(('value', 'answer', 'result'))}.txt"
    path = f"{APP if level == 1 else folder(rng, 1)}/{rng.choice(('package', 'config', 'settings', 'meta'))}.json"
    if level == 1:
        doc = {"name": rng.choice(WORDS), "version": f"{rng.randint(0, 9)}.{rng.randint(0, 20)}.{rng.randint(0, 9)}",
               "license": rng.choice(("mit", "apache", "bsd", "gpl")), "author": rng.choice(NAMES)}
        key = rng.choice(list(doc))
        where, answer, expr = f'the field "{key}"', doc[key], f"['{key}']"
    elif level == 2:
        doc = {"server": {"host": f"{rng.choice(WORDS)}.local", "port": rng.randint(1024, 9999)},
               "database": {"name": rng.choice(WORDS), "port": rng.randint(1024, 9999), "user": rng.choice(NAMES)}}
        section = rng.choice(list(doc))
        key = rng.choice(list(doc[section]))
        where, answer, expr = f'the field "{key}" of the object "{section}"', doc[section][key], f"['{section}']['{key}']"
    else:
        users = [{"name": n, "city": rng.choice(CITIES), "active": rng.random() < 0.5} for n in rng.sample(NAMES, rng.randint(5, 9))]
        users[0]["active"], users[1]["active"] = True, False
        doc = {"team": rng.choice(TEAMS), "users": users}
        answer = sum(u["active"] for u in users)
        return Draft({path: json.dumps(doc, indent=2) + "\n"},
                     f'Write the number of entries of the list "users" in {path} whose "active" field is true to {out}.',
                     (f"grep -c '\"active\": true' {path} > {out}",),  # the file is indented, one field per line
                     (Check("text", out, str(answer)),))
    return Draft({path: json.dumps(doc, indent=2) + "\n"}, f"Write the value of {where} in {path} to {out}.",
                 (f"python3 -c \"import json; print(json.load(open('{path}')){expr})\" > {out}",),
                 (Check("text", out, str(answer)),))


FAMILIES = (Family("csv_sum", csv_sum), Family("csv_filter", csv_filter), Family("json_field", json_field))
