#!/bin/bash
# A verifier that gives partial credit: reward.json holds the share of regions right.
pip install pytest==8.4.1
cd /app
python3 - <<'PY'
import csv, json
rows = list(csv.DictReader(open("/app/data/sales.csv")))
want = {}
for r in rows:
    want[r["region"]] = want.get(r["region"], 0.0) + int(r["units"]) * float(r["price"])
try:
    got = json.load(open("/app/report.json"))
except (OSError, ValueError):
    got = {}
right = sum(1 for k, v in want.items() if isinstance(got.get(k), (int, float)) and abs(got[k] - round(v, 2)) < 0.006)
json.dump({"reward": right / len(want)}, open("/logs/verifier/reward.json", "w"))
print(f"{right} of {len(want)} regions right")
PY
