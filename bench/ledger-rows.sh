#!/usr/bin/env bash
# PostgreSQL's CPU per ending for the two ways the spend ledger writes a batch (binary COPY, and
# the statement a batch repeating a written id falls back to), on a PostgreSQL of its own with
# the ledger's schema (made by the gateway's migrations), in alternating rounds.
#
#   bench/ledger-rows.sh [BATCHES=60] [ROWS_PER_BATCH=800]
#
# Needs PostgreSQL (initdb, pg_ctl) and Python 3; psycopg goes into a virtualenv of its own.
# Listens on a free loopback port; everything is stopped and removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
BATCHES="${1:-60}"
ROWS="${2:-800}"
. bench/gateways.sh
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q "psycopg[binary]"
start_postgres
# `spend` opens the ledger, which brings its schema up to date.
"$BIN/tollgate" spend --ledger "$PG_URL" --by day --from 2026-01-01 --to 2026-01-02 >/dev/null
"$tmp/venv/bin/python" bench/ledger_rows.py "$PG_URL" "$BATCHES" "$ROWS"
