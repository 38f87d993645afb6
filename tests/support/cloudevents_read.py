"""Reads Kafka records with the CloudEvents Python SDK's Kafka binding, as a consumer written in Python would.

stdin: one JSON object per record, {"headers": {name: base64}, "key": text or null, "value": base64 or null}.
stdout: one JSON object per record, {"attributes": {...}, "data": ...}: every attribute as the SDK parsed it
(`time` as microseconds since the epoch), the data as the SDK decoded it (bytes as {"base64": ...}).
A record the SDK cannot read as a CloudEvent fails the run.
"""

import base64
import datetime
import json
import sys

from cloudevents.core.bindings import kafka
from cloudevents.core.formats.json import JSONFormat

EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


def plain(value):
    if isinstance(value, datetime.datetime):
        return (value - EPOCH) // datetime.timedelta(microseconds=1)
    return value


for line in sys.stdin:
    record = json.loads(line)
    message = kafka.KafkaMessage(
        headers={name: base64.b64decode(value) for name, value in record["headers"].items()},
        key=record["key"],
        value=base64.b64decode(record["value"]) if record["value"] is not None else b"",
    )
    event = kafka.from_kafka(message, JSONFormat())
    data = event.get_data()
    if isinstance(data, (bytes, bytearray)):
        data = {"base64": base64.b64encode(data).decode()}
    attributes = {name: plain(value) for name, value in event.get_attributes().items()}
    print(json.dumps({"attributes": attributes, "data": data}))
