#!/bin/bash
set -euo pipefail
grep -c ' ERROR ' /app/app.log > /app/errors.txt
grep -c ' ERROR service=db ' /app/app.log > /app/db_errors.txt
