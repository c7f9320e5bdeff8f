"""A benchmark producer process: :class:`shardq.Client` sending jobs of its
share of the keys (key ``k-I`` for I % PRODUCERS == INDEX) in batches,
interleaved across keys, payload ``{"seq": N, "t": time_ns}``:

    python3 http_producer.py URLS INDEX PRODUCERS KEYS PER_KEY BATCH [RATE]

RATE (jobs/s for this producer, 0 = as fast as it can) paces whole batches
on an absolute schedule. Prints ``{"jobs", "seconds", "duplicates"}``.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients", "python"))

from shardq import Client, NewJob  # noqa: E402


def main() -> None:
    urls = sys.argv[1].split(",")
    index, producers, keys, per_key, batch = (int(x) for x in sys.argv[2:7])
    rate = float(sys.argv[7]) if len(sys.argv) > 7 else 0.0
    mine = [f"k-{k}" for k in range(keys) if k % producers == index]
    order = [(key, seq) for seq in range(per_key) for key in mine]
    c = Client(urls, retry_rounds=20)
    t0 = time.monotonic()
    sent = dup = 0
    for i in range(0, len(order), batch):
        if rate > 0:
            due = t0 + i / rate
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
        now = time.time_ns()
        chunk = [NewJob(key, f'{{"seq":{seq},"t":{now}}}') for key, seq in order[i:i + batch]]
        got = c.enqueue_many(chunk)
        sent += len(got)
        dup += sum(1 for g in got if g.duplicate)
    print(json.dumps({"jobs": sent, "seconds": time.monotonic() - t0, "duplicates": dup}), flush=True)


if __name__ == "__main__":
    main()
