"""The relay the transactional outbox articles describe, in Python: the yardstick of outboxd's polling path.

In one transaction: lock the oldest BATCH unpublished rows (FOR UPDATE SKIP LOCKED), send them, flush the
producer (every acknowledgement), mark them published, commit; until no row is left. No leases, retries, dead
letters or per-aggregate order: a failed send rolls the batch back. `outboxd-bench` runs it on its drain backlog;
the producer is idempotent with acks=all and linger.ms=5, as outboxd's. At the end it prints its CPU seconds.

    python3 examples/plain_poller.py DATABASE_URL BROKERS TOPIC BATCH
"""

import resource
import sys

import psycopg
from confluent_kafka import Producer

SELECT = """
    SELECT event_id, aggregate_id, event_type, payload::text FROM outbox_event
    WHERE published_at IS NULL AND dead_at IS NULL
    ORDER BY position NULLS FIRST, created_at, event_id
    LIMIT %s FOR UPDATE SKIP LOCKED
"""
MARK = "UPDATE outbox_event SET published_at = now() WHERE event_id = ANY(%s)"


def main(url, brokers, topic, batch):
    producer = Producer(
        {
            "bootstrap.servers": brokers,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
        }
    )
    with psycopg.connect(url) as conn:
        while True:
            with conn.transaction():
                rows = conn.execute(SELECT, (batch,)).fetchall()
                if not rows:
                    break
                for event_id, key, event_type, payload in rows:
                    headers = [("event_id", str(event_id)), ("event_type", event_type)]
                    while True:
                        try:
                            producer.produce(topic, key=key, value=payload, headers=headers)
                            break
                        except BufferError:
                            producer.poll(0.01)
                if producer.flush(60) != 0:
                    raise RuntimeError("the broker did not acknowledge every event within 60 s")
                conn.execute(MARK, ([row[0] for row in rows],))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(f"cpu_seconds {usage.ru_utime + usage.ru_stime:.3f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
