"""Writes ``benchmarks/data/repeated_traffic.json``: the repeated-traffic workload
of ``benchmarks/spec_decode.py --workload repeated``.

How it was made: the eight documents below (four small Python modules, two
operations documents, a changelog and a tool-calling agent's system prompt)
were written for this benchmark by the llmesh developers; each is asked eight
tasks of its kind (edit, explain, test, summarise, extract, call a tool...),
64 requests in all, in an order shuffled with a fixed seed (documents and
tasks interleave, as in a shared deployment). Requests about one document
share the document and often the shape of the answer (the code again with a
change, the same fields, the same tool-call JSON), which is what suffix
decoding's cross-request cache exploits; every request is distinct, so a
response cache would not answer any of them.

    python benchmarks/make_repeated_traffic.py    # rewrites the JSON (deterministic)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data" / "repeated_traffic.json"
SEED = 20261204

INVENTORY = '''\
from dataclasses import dataclass


@dataclass
class Item:
    sku: str
    name: str
    quantity: int
    unit_price: float


def total_value(items):
    total = 0.0
    for item in items:
        total += item.quantity * item.unit_price
    return total


def low_stock(items, threshold=5):
    result = []
    for item in items:
        if item.quantity < threshold:
            result.append(item.sku)
    return result


def restock(items, sku, amount):
    for item in items:
        if item.sku == sku:
            item.quantity += amount
            return item
    raise KeyError(sku)
'''

RATE_LIMITER = '''\
import time


class TokenBucket:
    def __init__(self, rate, capacity):
        self.rate = rate
        self.capacity = capacity
        self.tokens = capacity
        self.updated = time.monotonic()

    def _refill(self):
        now = time.monotonic()
        elapsed = now - self.updated
        self.tokens = min(self.capacity, self.tokens + elapsed * self.rate)
        self.updated = now

    def try_acquire(self, cost=1):
        self._refill()
        if self.tokens >= cost:
            self.tokens -= cost
            return True
        return False

    def wait_time(self, cost=1):
        self._refill()
        missing = cost - self.tokens
        if missing <= 0:
            return 0.0
        return missing / self.rate
'''

CSV_REPORT = '''\
import csv


def read_rows(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def group_by(rows, key):
    groups = {}
    for row in rows:
        groups.setdefault(row[key], []).append(row)
    return groups


def summarize(rows, key, value):
    summary = {}
    for name, members in group_by(rows, key).items():
        numbers = [float(row[value]) for row in members]
        summary[name] = {
            "count": len(numbers),
            "total": sum(numbers),
            "mean": sum(numbers) / len(numbers),
        }
    return summary


def write_summary(summary, path):
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["group", "count", "total", "mean"])
        for name, stats in sorted(summary.items()):
            writer.writerow([name, stats["count"], stats["total"], stats["mean"]])
'''

RETRY = '''\
import random
import time


def retry(call, attempts=5, base_delay=0.1, max_delay=2.0, retry_on=(ConnectionError,)):
    delay = base_delay
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except retry_on:
            if attempt == attempts:
                raise
            time.sleep(delay + random.uniform(0, delay))
            delay = min(delay * 2, max_delay)


def fetch_with_retry(client, url):
    return retry(lambda: client.get(url), attempts=3)
'''

RUNBOOK = '''\
Runbook: the order service returns errors

1. Check the dashboard "Orders / Overview". If the error rate is above 2 percent
for five minutes, page the on-call engineer for the order service.
2. Look at the last deployment. If a deployment finished in the last thirty
minutes, roll it back with the deploy tool and watch the error rate for ten
minutes.
3. If the database latency panel shows more than 200 milliseconds at the 99th
percentile, check the connection pool: the pool size is 50 per instance and the
alert fires at 45 connections in use.
4. If the payment provider status page reports an incident, switch the checkout
to the backup provider with the feature flag "payments.backup" and post a note
in the incident channel.
5. When the error rate is below 0.5 percent for fifteen minutes, close the
incident and write a short summary: what happened, when it started, when it
ended, and what we will change.
'''

POLICY = '''\
Expense policy for travel

Employees may book economy class for flights shorter than six hours and premium
economy for longer flights. Hotels are reimbursed up to 180 euros a night in
most cities and up to 260 euros a night in London, Paris, New York, Tokyo and
Zurich. Meals are covered up to 60 euros a day when the employee is away from
home overnight. Taxis are allowed between 22:00 and 06:00 or when public
transport would take more than twice as long. Receipts must be uploaded within
30 days of the end of the trip; claims without receipts are not paid. A manager
approves every trip that costs more than 1,500 euros before it is booked.
Personal days added to a business trip are allowed if they do not increase the
cost of the flight.
'''

CHANGELOG = '''\
Release 4.2.0 (2026-11-18)

Added
- Bulk export of invoices as CSV and JSON from the billing page.
- Webhooks for subscription changes: created, renewed, cancelled, past_due.
- A "read only" role for auditors.

Changed
- The API rate limit for the free plan is now 60 requests per minute (was 30).
- Invoice numbers now include the year: INV-2026-000123.

Fixed
- Time zones on scheduled reports were ignored for users outside UTC.
- Duplicate emails were sent when a payment was retried.

Deprecated
- The v1 customers endpoint will be removed in release 5.0.0; use v2.
'''

AGENT = '''\
You are an assistant that manages a calendar. To act, answer with one JSON
object and nothing else, in this form:
{"tool": "<name>", "arguments": {...}}
Tools:
- create_event: arguments title (string), date (YYYY-MM-DD), start (HH:MM),
  duration_minutes (integer), attendees (list of email addresses)
- find_free_slot: arguments date (YYYY-MM-DD), duration_minutes (integer)
- cancel_event: arguments event_id (string), notify (true or false)
- list_events: arguments date (YYYY-MM-DD)
'''

CODE_TASKS = [
    "Add type hints to every function and method in this code. Return the whole file.",
    "Add a docstring to every function and class in this code. Return the whole file.",
    "Write pytest unit tests for this code.",
    "Explain what this code does, function by function.",
    "Rename every variable called `items` or `rows` to `records` and return the whole file.",
    "Find possible bugs or edge cases in this code and show the fixed code.",
    "Add logging with the logging module to this code. Return the whole file.",
    "Rewrite this code so that it has no loops where a comprehension would do. Return the "
    "whole file.",
]
TEXT_TASKS = [
    "Summarise this document in three sentences.",
    "List the key points of this document as bullet points.",
    "Write five questions and answers (an FAQ) about this document.",
    "Rewrite this document in simpler English.",
    "Extract every number, time and date in this document with what it refers to.",
    "Write a short email to the team announcing this document.",
    "Turn this document into a table with two columns.",
    "Give this document a title and a one-line description.",
]
AGENT_TASKS = [
    "Book a 30 minute meeting called Design review on 2026-12-08 at 10:00 with "
    "ana@example.com and li@example.com.",
    "Find a free 60 minute slot on 2026-12-09.",
    "Cancel event ev-1042 and tell the attendees.",
    "What is on my calendar on 2026-12-10?",
    "Book a 45 minute meeting called Budget planning on 2026-12-11 at 14:30 with "
    "sam@example.com.",
    "Find a free 30 minute slot on 2026-12-12.",
    "Cancel event ev-2077 without notifying anyone.",
    "Book a 60 minute meeting called Team lunch on 2026-12-15 at 12:00 with "
    "ana@example.com, li@example.com and sam@example.com.",
]

DOCUMENTS = [
    ("inventory.py", "code", INVENTORY), ("rate_limiter.py", "code", RATE_LIMITER),
    ("csv_report.py", "code", CSV_REPORT), ("retry.py", "code", RETRY),
    ("runbook", "text", RUNBOOK), ("travel policy", "text", POLICY),
    ("changelog", "text", CHANGELOG), ("calendar agent", "agent", AGENT),
]


def requests() -> list[dict[str, object]]:
    """The 64 requests: each {document, kind, messages}, in the shuffled order."""
    out: list[dict[str, object]] = []
    for name, kind, body in DOCUMENTS:
        if kind == "agent":
            for task in AGENT_TASKS:
                out.append({"document": name, "kind": kind, "messages": [
                    {"role": "system", "content": body}, {"role": "user", "content": task}]})
            continue
        tasks = CODE_TASKS if kind == "code" else TEXT_TASKS
        for task in tasks:
            fence = f"```python\n{body}```" if kind == "code" else body
            out.append({"document": name, "kind": kind, "messages": [
                {"role": "user", "content": f"{fence}\n\n{task}"}]})
    random.Random(SEED).shuffle(out)
    return out


def main() -> None:
    OUT.write_text(json.dumps({"seed": SEED, "requests": requests()}, indent=1) + "\n")
    print(f"wrote {OUT} ({len(requests())} requests)")


if __name__ == "__main__":
    main()
