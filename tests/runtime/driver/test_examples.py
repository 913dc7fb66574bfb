"""Every example pipeline against an oracle computed from its input, many small steps each;
dead letters once with reasons; an aborted step transaction rerun and applied once."""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

from confluent_kafka import Producer

from sparkstep.examples import keyed_sum, orders, sessions
from sparkstep.io.errors import StepAbortedError
from sparkstep.io.output import OutputWriter
from tests.io.fixtures import high_watermark, read_committed_many
from tests.runtime.driver.fixtures import (
    HarnessFactory,
    integrate,
    keyed_sum_oracle,
    produce_keyed,
    produce_raw,
    wait_until,
)


def _produce(bootstrap: str, topic: str, docs: list[dict[str, Any]]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    for doc in docs:
        producer.produce(topic, value=json.dumps(doc).encode())
    assert producer.flush(30) == 0


def _ends(bootstrap: str, topic: str, partitions: int) -> dict[tuple[str, int], int]:
    return {(topic, p): high_watermark(bootstrap, topic, p) for p in range(partitions)}


def test_sessions_close_on_logged_time_and_count_every_click(
    harness_factory: HarnessFactory, bootstrap_servers: str, topic_factory
) -> None:
    topic = topic_factory("clicks", partitions=2)
    rng = random.Random(3)
    clicks = [{"user": f"u{rng.randrange(8)}", "page": f"/p{i}"} for i in range(120)]
    _produce(bootstrap_servers, topic, clicks)
    harness = harness_factory(sessions.pipeline, {"clicks": topic})
    harness.build()
    harness.start()
    expected = Counter(doc["user"] for doc in clicks)

    def closed_clicks() -> Counter[str]:
        got: Counter[str] = Counter()
        for row, weight in integrate(harness.output()).items():
            doc = dict(row)
            got[str(doc["user"])] += int(doc["clicks"]) * weight
        return got

    # Sessions close only on timer ticks, after TIMEOUT_S of logged time without clicks.
    wait_until(lambda: closed_clicks() == expected, 240, "every session closed")
    harness.stop()
    rows = integrate(harness.output())
    assert all(w == 1 for w in rows.values())
    assert all(dict(r)["closed_ms"] > dict(r)["opened_ms"] for r in rows)


def test_orders_join_equals_the_join_of_all_input(
    harness_factory: HarnessFactory, bootstrap_servers: str, topic_factory
) -> None:
    orders_topic = topic_factory("orders", partitions=2)
    customers_topic = topic_factory("customers", partitions=1)
    rng = random.Random(5)
    customers = [{"customer_id": c, "name": f"c{c}"} for c in range(10)]
    # A rename: retract customer 3 and insert it again under a new name.
    renames = [
        {"customer_id": 3, "name": "c3", "__weight": -1},
        {"customer_id": 3, "name": "renamed"},
    ]
    all_orders = [
        {"order_id": i, "customer_id": rng.randrange(12), "amount": rng.randrange(100)}
        for i in range(150)
    ]
    _produce(bootstrap_servers, orders_topic, all_orders[:80])
    _produce(bootstrap_servers, customers_topic, customers)
    _produce(bootstrap_servers, orders_topic, all_orders[80:])
    _produce(bootstrap_servers, customers_topic, renames)
    harness = harness_factory(
        orders.pipeline, {"orders": orders_topic, "customers": customers_topic}
    )
    harness.build()
    harness.start()
    harness.wait_consumed(
        {
            **_ends(bootstrap_servers, orders_topic, 2),
            **_ends(bootstrap_servers, customers_topic, 1),
        }
    )
    harness.stop()

    names = {c["customer_id"]: c["name"] for c in customers}
    names[3] = "renamed"
    expected = {
        tuple(
            sorted(
                {
                    "customer_id": o["customer_id"],
                    "order_id": o["order_id"],
                    "amount": o["amount"],
                    "name": names[o["customer_id"]],
                }.items()
            )
        ): 1
        for o in all_orders
        if o["customer_id"] in names
    }
    assert integrate(harness.output()) == expected


def test_dead_letters_once_and_an_aborted_step_rerun_once(
    harness_factory: HarnessFactory, bootstrap_servers: str, topic_factory, monkeypatch
) -> None:
    topic = topic_factory("numbers", partitions=1)
    sent = produce_keyed(bootstrap_servers, topic, 60, keys=7, seed=9)
    # The last dead letter's key and value are bytes that are not UTF-8: they reach the
    # dead-letter topic as they were.
    raw = [b"{broken", None, b'{"key": "x", "value": "NaN?"}', b"\xfe\xff{"]
    produce_raw(bootstrap_servers, topic, raw, keys=[None, b"k", None, b"\xff\x00k"])
    sent += produce_keyed(bootstrap_servers, topic, 60, keys=7, seed=10)

    # Fault injection: the transaction of every third step is aborted once, after the stateful
    # stage ran; the runtime must rerun the step with the same division (workers answer with
    # the recorded deltas) and the state must be applied once.
    real_write = OutputWriter.write
    aborted: list[int] = []

    def flaky_write(self: OutputWriter, step: int, *args: Any, **kw: Any) -> Any:
        if step % 3 == 1 and step not in aborted:
            aborted.append(step)
            raise StepAbortedError(f"injected abort of step {step}")
        return real_write(self, step, *args, **kw)

    monkeypatch.setattr(OutputWriter, "write", flaky_write)
    harness = harness_factory(keyed_sum.pipeline, {"events": topic}, max_records_per_step=25)
    harness.build()
    harness.start()
    harness.wait_consumed(_ends(bootstrap_servers, topic, 1))
    harness.stop()
    assert len(aborted) >= 2

    seen = read_committed_many(
        bootstrap_servers, [harness.output_topic, f"{harness.name}.dlq", f"{harness.name}.steps"]
    )
    expected = {
        (("count", c), ("key", k), ("sum", s)): 1 for k, (s, c) in keyed_sum_oracle(sent).items()
    }
    assert integrate(seen[harness.output_topic]) == expected
    letters = seen[f"{harness.name}.dlq"]
    assert sorted((r.key or b"", r.value) for r in letters) == sorted(
        [
            (b"", b"{broken"),
            (b"k", b""),
            (b"", b'{"key": "x", "value": "NaN?"}'),
            (b"\xff\x00k", b"\xfe\xff{"),
        ]
    )
    assert all(dict(r.headers)["sparkstep.reason"] for r in letters)
    logged = [json.loads(r.value or b"{}") for r in seen[f"{harness.name}.steps"]]
    assert [r["step"] for r in logged] == list(range(len(logged)))
    assert sum(r["dlq_count"] for r in logged) == 4
