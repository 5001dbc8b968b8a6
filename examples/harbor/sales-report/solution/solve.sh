#!/bin/bash
python3 - <<'PY'
import csv, json, os
out = {}
for r in csv.DictReader(open("/app/data/sales.csv")):
    out[r["region"]] = out.get(r["region"], 0.0) + int(r["units"]) * float(r["price"])
json.dump({k: round(v, 2) for k, v in out.items()}, open(os.environ["REPORT_PATH"], "w"))
PY
