"""A batch's lines, windows, parts and progress, without Redis or a worker."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from tokenfleet import batch_output
from tokenfleet.batch_client import line_of, openai_body
from tokenfleet.batch_lines import LineError, error_line, parse
from tokenfleet.batch_records import Batch, BatchRecord, RequestCounts, window_s
from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.file_store import DirectoryStore
from tokenfleet.shared.schemas import GenerationRequest
from tokenfleet.workers.batch_cli import progress

COMPLETIONS = "/v1/completions"


def test_a_window_is_24h_or_shorter_in_hours_minutes_or_seconds() -> None:
    assert window_s("24h") == 86_400
    assert window_s("90m") == 5_400 and window_s("5s") == 5
    for bad in ("0h", "2d", "24", "h", "169h", "-1s"):
        with pytest.raises(InvalidRequest, match="completion_window"):
            window_s(bad)


@pytest.mark.parametrize(("raw", "code"), [
    (b"{not json", "invalid_json"),
    (b"[1, 2]", "invalid_request"),
    (b'{"method": "POST", "url": "/v1/completions", "body": {}}', "missing_custom_id"),
    (b'{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}',
     "invalid_method"),
    (b'{"custom_id": "a", "url": "/v1/chat/completions", "body": {}}', "invalid_url"),
    (b'{"custom_id": "a", "url": "/v1/completions", "body": "hi"}', "invalid_request"),
])
def test_a_line_without_what_every_line_needs_says_what_is_missing(raw: bytes,
                                                                   code: str) -> None:
    parsed = parse(raw, COMPLETIONS)
    assert isinstance(parsed.body, LineError) and parsed.body.code == code


def test_a_good_line_gives_its_custom_id_and_body() -> None:
    parsed = parse(b'{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}',
                   COMPLETIONS)
    assert parsed.custom_id == "a" and parsed.body == {"prompt": "x"}
    line = orjson.loads(error_line("a", LineError("c", "m")))
    assert line["id"].startswith("batch_req_") and line["response"] is None
    assert line["error"] == {"code": "c", "message": "m"}


def test_joining_parts_keeps_each_line_once_in_the_order_they_finished(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    batch_output.write_part(store, "b1", "out", 1, [(2, b'{"x":2}'), (0, b'{"x":0}')])
    batch_output.write_part(store, "b1", "out", 2, [(0, b'{"x":"again"}'), (1, b'{"x":1}')])
    batch_output.write_part(store, "b1", "err", 3, [(3, b'{"e":3}')])
    joined = b"".join(batch_output.joined(store, "b1", "out", parts=3, total=4))
    assert joined.splitlines() == [b'{"x":2}', b'{"x":0}', b'{"x":1}']
    batch_output.delete_parts(store, "b1", 3)
    assert not (tmp_path / "batches" / "b1").exists()


def test_a_generation_request_becomes_the_openai_body_of_its_endpoint() -> None:
    chat = GenerationRequest(messages=[{"role": "user", "content": "Hi"}],
                             sampling={"max_new_tokens": 8, "temperature": 0.0})
    line = orjson.loads(line_of(3, chat, "/v1/chat/completions"))
    assert line["custom_id"] == "request-3" and line["url"] == "/v1/chat/completions"
    assert line["body"] == {"model": "default", "max_tokens": 8, "temperature": 0.0,
                            "messages": [{"role": "user", "content": "Hi"}]}
    plain = openai_body(GenerationRequest(prompt="Hello", sampling={"max_new_tokens": 4}))
    assert plain == {"model": "default", "prompt": "Hello", "max_tokens": 4}


def test_the_progress_line_says_done_failed_total_rate_and_time_left() -> None:
    batch = Batch(id="batch_1", endpoint=COMPLETIONS, input_file_id="file-1",
                  completion_window="24h", status="in_progress", created_at=0,
                  request_counts=RequestCounts(total=100, completed=20, failed=5))
    line = progress(BatchRecord(batch=batch, tenant="default", tokens=500), elapsed_s=10.0)
    assert line == ("batch_1 in_progress: 20 done / 5 failed / 100 total, 50.0 tokens/s, "
                    "ETA 30s")
