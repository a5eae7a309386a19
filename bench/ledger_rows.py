"""PostgreSQL's CPU per ending for the ledger's two ways of writing a batch: binary COPY into
both tables (what the writer does) and the statement it falls back to when a batch repeats a
written id (arrays unnested, ON CONFLICT DO NOTHING, the charges of new endings). Run by
bench/ledger-rows.sh, which starts the PostgreSQL and brings the schema up with the gateway's
own migrations; the server's CPU is read from /proc for the connection's backend.

    ledger_rows.py URL BATCHES ROWS_PER_BATCH
"""

import os
import sys

import psycopg
from psycopg.types.numeric import Int8

ENDINGS = ("request_id", "ending", "at_ms", "tenant", "key_id", "model", "end_user",
           "input_tokens", "cached_tokens", "output_tokens", "tool_calls", "cost_micro_usd")
ENDING_TYPES = ["text", "text", "int8", "text", "text", "text", "text",
                "int8", "int8", "int8", "int8", "int8"]
CHARGES = ("request_id", "scope", "label", "period_ms", "period_id", "period_start_ms",
           "period_end_ms", "unit", "amount")
CHARGE_TYPES = ["text", "text", "text", "int8", "int8", "int8", "int8", "text", "int8"]
DAY = 86_400_000
T0 = 1_764_720_000_000

# The fallback statement of crates/ledger/src/writer.rs, in psycopg's placeholders.
STATEMENT = (
    "WITH new AS (INSERT INTO tollgate_endings (" + ", ".join(ENDINGS) + ") "
    "SELECT * FROM UNNEST(" + ", ".join(f"%s::{t}[]" for t in ENDING_TYPES) + ") "
    "ON CONFLICT (request_id) DO NOTHING RETURNING request_id) "
    "INSERT INTO tollgate_charges (" + ", ".join(CHARGES) + ") "
    "SELECT c.* FROM UNNEST(" + ", ".join(f"%s::{t}[]" for t in CHARGE_TYPES) + ") "
    "AS c(" + ", ".join(CHARGES) + ") WHERE c.request_id IN (SELECT request_id FROM new)"
)


def batch(first, n):
    """n endings with one charge each, ids as the gateway makes them."""
    endings, charges = [], []
    for i in range(first, first + n):
        rid = f"tg-0123456789ab-{i:07x}"
        at = T0 + i
        endings.append((rid, "settled", at, "acme", f"k-{i % 50}", "gpt-4o-mini", None,
                        120, 0, 40, 0, None))
        charges.append((rid, f"per-key|key:k-{i % 50}", "day", DAY, at // DAY,
                        at // DAY * DAY, (at // DAY + 1) * DAY, "tokens", 160))
    return endings, charges


def by_copy(c, endings, charges):
    with c.transaction():
        cur = c.cursor()
        for table, cols, types, rows in (("tollgate_endings", ENDINGS, ENDING_TYPES, endings),
                                         ("tollgate_charges", CHARGES, CHARGE_TYPES, charges)):
            sql = f"COPY {table} ({', '.join(cols)}) FROM STDIN (FORMAT binary)"
            with cur.copy(sql) as cp:
                cp.set_types(types)
                for r in rows:
                    cp.write_row(r)


def by_statement(c, endings, charges):
    def columns(rows, types):
        return [[None if v is None else Int8(v) if t == "int8" else v for v in col]
                for col, t in zip(zip(*rows), types)]
    c.execute(STATEMENT, columns(endings, ENDING_TYPES) + columns(charges, CHARGE_TYPES),
              binary=True)


def cpu_ticks(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def main():
    url, batches, rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    hz = os.sysconf("SC_CLK_TCK")
    first = 0
    print(f"{batches} batches of {rows} endings (one charge each) per round; "
          "PostgreSQL CPU per ending, µs")
    print()
    print("| round | binary COPY | statement (UNNEST, ON CONFLICT) |")
    print("|---|---|---|")
    for round_ in range(1, 4):
        cells = []
        for write in (by_copy, by_statement):
            with psycopg.connect(url, autocommit=True) as c:
                pid = c.execute("SELECT pg_backend_pid()").fetchone()[0]
                data = []
                for _ in range(batches):
                    data.append(batch(first, rows))
                    first += rows
                t0 = cpu_ticks(pid)
                for endings, charges in data:
                    write(c, endings, charges)
                cells.append((cpu_ticks(pid) - t0) / hz / (batches * rows) * 1e6)
        print(f"| {round_} | {cells[0]:.1f} | {cells[1]:.1f} |")


if __name__ == "__main__":
    main()
