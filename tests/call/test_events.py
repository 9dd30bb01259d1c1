"""The runner's reading of a tool's event lines (``runner.call.events``): every kind of
event, each bound, the scrub; what is dropped is counted, never a failure."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest

from runner.call.events import MAX_EVENTS, ToolEvents
from runner.schema.redaction import NO_SECRETS, Scrubber

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\nfake").decode()


def line(event: object) -> bytes:
    return json.dumps(event).encode()


def read(*events: object, scrubber: Scrubber = NO_SECRETS) -> tuple[list[dict[str, Any]], ToolEvents]:
    heard: list[dict[str, Any]] = []
    sink = ToolEvents(scrubber, heard.append)
    for event in events:
        sink.event(event if isinstance(event, bytes) else line(event))
    return heard, sink


@pytest.mark.parametrize(
    "event",
    [
        {"progress": 40, "total": 100, "message": "reading"},
        {"progress": 0.5},
        {"log": "info", "data": {"rows": 3}},
        {"log": "emergency", "data": "disk full", "logger": "io"},
        {"content": {"type": "text", "text": "hello"}},
        {"content": {"type": "image", "mimeType": "image/png", "data": PNG}},
        {"content": {"type": "audio", "mimeType": "audio/wav", "data": PNG}},
        {
            "content": {
                "type": "resource",
                "resource": {"uri": "file:///a.txt", "mimeType": "text/plain", "text": "a"},
            }
        },
        {"content": {"type": "resource", "resource": {"uri": "data:x", "blob": PNG}}},
    ],
)
def test_each_kind_of_event_is_handed_on_as_written(event: dict[str, Any]) -> None:
    heard, sink = read(event)
    assert heard == [event]
    assert sink.ignored_count == 0
    assert sink.content == ([event["content"]] if "content" in event else [])


@pytest.mark.parametrize(
    "record",
    [
        b"not json",
        b"[1, 2]",
        line({"unknown": 1}),
        line({"progress": 1, "log": "info"}),  # two kinds at once
        b'{"progress": NaN}',
        b'{"progress": 1e999}',
        b'{"log": "info", "data": Infinity}',
        line({"progress": -1}),
        line({"progress": True}),
        line({"progress": 1, "total": 0}),
        line({"progress": 1, "message": 5}),
        line({"log": "loud", "data": "x"}),
        line({"content": {"type": "video", "data": PNG}}),
        line({"content": {"type": "image", "mimeType": "image/svg+xml", "data": PNG}}),
        line({"content": {"type": "audio", "mimeType": "audio/flac", "data": PNG}}),
        line({"content": {"type": "image", "mimeType": "image/png", "data": "not base64!"}}),
        line({"content": {"type": "text", "text": 5}}),
        line({"content": {"type": "resource", "resource": {"uri": "x", "text": "a", "blob": PNG}}}),
        line({"content": {"type": "resource", "resource": {"text": "a"}}}),
        b"\xff\xfe",
    ],
)
def test_a_malformed_unknown_or_non_finite_event_is_dropped_and_counted(record: bytes) -> None:
    heard, sink = read(record)
    assert heard == []
    assert sink.content == []
    assert sink.ignored_count == 1


def test_past_a_thousand_events_the_rest_are_dropped_and_counted() -> None:
    heard, sink = read(*({"log": "debug", "data": n} for n in range(MAX_EVENTS + 50)))
    assert len(heard) == MAX_EVENTS
    assert sink.ignored_count == 50


def test_progress_never_goes_past_its_total_nor_back() -> None:
    heard, sink = read(
        {"progress": 50, "total": 100},
        {"progress": 250, "total": 100},  # forged: past 100 %
        {"progress": 400, "total": 100},  # no further than the whole: not forward
        {"progress": 20, "total": 100},  # backwards
    )
    assert heard == [{"progress": 50, "total": 100}, {"progress": 100, "total": 100}]
    assert sink.ignored_count == 2


def test_secrets_are_scrubbed_from_every_text_log_and_message() -> None:
    secret = "hunter2-secret"
    scrubber = Scrubber.of([secret])
    heard, sink = read(
        {"log": "info", "data": {"note": f"token={secret}", secret: [secret]}},
        {"log": "info", "data": secret, "logger": secret},
        {"progress": 1, "message": f"using {secret}"},
        {"content": {"type": "text", "text": f"the key is {secret}"}},
        {"content": {"type": "resource", "resource": {"uri": f"file:///{secret}", "text": secret}}},
        {
            "content": {
                "type": "resource",
                "resource": {"uri": "u", "mimeType": f"text/x-{secret}", "text": "a"},
            }
        },
        scrubber=scrubber,
    )
    assert len(heard) == 6
    assert secret not in json.dumps(heard)
    assert secret not in json.dumps(sink.content)
    assert heard[0] == {"log": "info", "data": {"note": "token=***", "***": ["***"]}}


def test_a_resource_whose_media_type_is_not_one_is_dropped_and_counted() -> None:
    heard, sink = read(
        {
            "content": {
                "type": "resource",
                "resource": {"uri": "u", "mimeType": "a note, not a type", "text": "a"},
            }
        },
        {"content": {"type": "resource", "resource": {"uri": "u", "mimeType": "text/csv", "text": "a,b"}}},
    )
    assert [event["content"]["resource"]["mimeType"] for event in heard] == ["text/csv"]
    assert sink.ignored_count == 1


def test_unknown_keys_of_a_block_are_left_out() -> None:
    heard, _ = read({"content": {"type": "text", "text": "a", "_meta": {"x": 1}}})
    assert heard == [{"content": {"type": "text", "text": "a"}}]


def test_a_listener_that_raises_does_not_stop_the_events() -> None:
    def broken(event: dict[str, Any]) -> None:
        raise RuntimeError("listener bug")

    sink = ToolEvents(NO_SECRETS, broken)
    sink.event(line({"content": {"type": "text", "text": "kept"}}))
    assert sink.content == [{"type": "text", "text": "kept"}]
    assert sink.ignored_count == 0


def test_a_block_whose_data_holds_a_secret_is_dropped_whole_and_counted() -> None:
    # A secret of base64's alphabet passes as the data itself; any other, inside the bytes
    # the data decodes to (an image's text chunk). Neither can be cut out and leave an image.
    plain, hidden = "Zm9vYmFyYmF6cXV4", "sk-live hidden key"
    scrubber = Scrubber.of([plain, hidden])
    inside = base64.b64encode(b"\x89PNG\r\n\x1a\ntEXt" + hidden.encode() + b"\x00").decode()
    heard, sink = read(
        {"content": {"type": "image", "mimeType": "image/png", "data": plain}},
        {"content": {"type": "audio", "mimeType": "audio/wav", "data": plain}},
        {"content": {"type": "resource", "resource": {"uri": "data:x", "blob": plain}}},
        {"content": {"type": "image", "mimeType": "image/png", "data": inside}},
        {"content": {"type": "image", "mimeType": "image/png", "data": PNG}},
        scrubber=scrubber,
    )
    assert heard == [{"content": {"type": "image", "mimeType": "image/png", "data": PNG}}]
    assert sink.content == [heard[0]["content"]]
    assert sink.ignored_count == 4


def test_a_secret_of_digits_never_passes_as_a_number_of_a_log_or_progress() -> None:
    pin = "73914682"
    heard, sink = read(
        {"log": "info", "data": 73914682},
        {"log": "info", "data": {"n": [73914682, 5], "f": 73914682.5}},
        {"progress": 73914682},
        {"progress": 1, "total": 739146820},
        {"progress": 2, "total": 4},
        scrubber=Scrubber.of([pin]),
    )
    assert heard == [
        {"log": "info", "data": "***"},
        {"log": "info", "data": {"n": ["***", 5], "f": "***"}},
        {"progress": 2, "total": 4},
    ]
    assert sink.ignored_count == 2


def test_a_sensitive_number_is_scrubbed_by_its_json_text_and_a_short_one_is_no_secret() -> None:
    scrubber = Scrubber.of([{"pin": 48151623, "ratio": 0.25, "flag": True, "port": 1, "code": 12}])
    assert (
        scrubber.scrub_text("bad pin 48151623, ratio 0.25, true, 1, 12")
        == "bad pin ***, ratio ***, true, 1, 12"
    )
    # An integer sent as 48151623.0 passes "type: integer", and the tool prints 48151623.
    assert Scrubber.of([48151623.0]).scrub_text("pin 48151623 or 48151623.0") == "pin *** or ***"
    assert "1" + "0" * 400 in Scrubber.of([10**400]).secrets  # past a float's range: no OverflowError
    heard, sink = read(
        {"progress": 1, "total": 100},
        {"content": {"type": "image", "mimeType": "image/png", "data": PNG}},
        scrubber=Scrubber.of([{"account": 1, "cvv": 123}]),
    )
    assert len(heard) == 2 and sink.ignored_count == 0  # a short secret is not looked for in data


def test_many_secrets_are_looked_for_in_a_large_image_in_one_pass() -> None:
    # Each secret was a pass over the image's bytes, on the event loop: 20,000 secrets
    # (a sensitive array) and a 1 MiB image took seconds.
    scrubber = Scrubber.of([f"secret-value-{n:06d}" for n in range(20_000)])
    image = base64.b64encode(bytes(range(256)) * 4096).decode()
    started = time.process_time()
    heard, _ = read({"content": {"type": "image", "mimeType": "image/png", "data": image}}, scrubber=scrubber)
    assert len(heard) == 1
    assert time.process_time() - started < 2.0
