"""A batch's lines, windows, parts and progress, without Redis or a worker."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from tokenfleet.batches import output as batch_output
from tokenfleet.client.batches import line_of, results
from tokenfleet.batches.lines import LineError, error_line, job_error, parse, refusal
from tokenfleet.client.batch_records import Batch, BatchRecord, RequestCounts, window_s
from tokenfleet.shared.wire.errors import InvalidRequest
from tokenfleet.shared.file_store import DirectoryStore
from tokenfleet.openai.answer import failure
from tokenfleet.openai.errors import CONTEXT_LENGTH
from tokenfleet.openai.translate import to_body
from tokenfleet.shared.wire.schemas import GenerationRequest, JobState, JobStatus
from tokenfleet.cli.batch import progress

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


def test_a_refused_request_is_a_response_with_the_single_routes_status_and_body() -> None:
    refused = refusal(CONTEXT_LENGTH, "prompt has 9 tokens; this gateway allows 4",
                      param="prompt")
    line = orjson.loads(error_line("a", refused))
    assert line["error"] is None and line["custom_id"] == "a"
    response = line["response"]
    assert response["status_code"] == 400 and response["request_id"].startswith("req_")
    single = CONTEXT_LENGTH.error("prompt has 9 tokens; this gateway allows 4", param="prompt")
    assert response["body"] == single.body


def test_a_job_that_failed_on_its_worker_is_a_500_naming_its_job() -> None:
    state = JobState(id="default:ab", status=JobStatus.FAILED, error="out of memory")
    line = orjson.loads(error_line("a", job_error(state)))
    assert line["error"] is None and line["response"]["status_code"] == 500
    assert line["response"]["request_id"] == "default:ab"
    assert line["response"]["body"]["error"] == {
        "message": failure(state), "type": "server_error", "param": None, "code": None}
    cancelled = JobState(id="default:ab", status=JobStatus.CANCELLED)
    line = orjson.loads(error_line("a", job_error(cancelled)))
    assert line["response"] is None and line["error"]["code"] == "batch_cancelled"


def test_joining_parts_keeps_each_line_once_in_the_order_they_finished(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    batch_output.write_part(store, "b1", "out", 1, [(2, b'{"x":2}'), (0, b'{"x":0}')])
    batch_output.write_part(store, "b1", "out", 2, [(0, b'{"x":"again"}'), (1, b'{"x":1}')])
    batch_output.write_part(store, "b1", "err", 3, [(3, b'{"e":3}')])
    joined = b"".join(batch_output.joined(store, "b1", "out", parts=3, total=4))
    assert joined.splitlines() == [b'{"x":2}', b'{"x":0}', b'{"x":1}']
    batch_output.delete_parts(store, "b1", 3)
    assert not (tmp_path / "batches" / "b1").exists()


def test_results_in_input_order_keep_every_line_of_a_duplicate_or_missing_custom_id(
    tmp_path: Path
) -> None:
    store = DirectoryStore(tmp_path)
    store.put("files/in", [b'{"custom_id": "a"}\n{not json\n{"custom_id": "b"}\n'
                           b'{"custom_id": "a"}\n{"body": {}}\n'])
    store.put("files/out", [b'{"custom_id": "b", "n": 2}\n{"custom_id": "a", "n": 0}\n'])
    store.put("files/err", [b'{"custom_id": null, "n": 1}\n{"custom_id": "a", "n": 3}\n'
                            b'{"custom_id": null, "n": 4}\n'])
    batch = Batch(id="batch_1", endpoint=COMPLETIONS, input_file_id="in",
                  completion_window="24h", status="completed", created_at=0,
                  output_file_id="out", error_file_id="err")
    assert [line["n"] for line in results(store, batch, "input")] == [0, 1, 2, 3, 4]
    assert [line["n"] for line in results(store, batch)] == [2, 0, 1, 3, 4]


def test_a_generation_request_is_stored_as_it_is_and_read_as_its_endpoints_body() -> None:
    chat = GenerationRequest(messages=[{"role": "user", "content": "Hi"}],
                             sampling={"max_new_tokens": 8, "temperature": 0.0})
    raw = line_of(3, chat, "/v1/chat/completions")
    line = orjson.loads(raw)
    assert line["custom_id"] == "request-3" and line["url"] == "/v1/chat/completions"
    assert GenerationRequest.model_validate(line["request"]) == chat
    assert parse(raw, "/v1/chat/completions").body == {
        "model": "default", "max_tokens": 8, "temperature": 0.0,
        "messages": [{"role": "user", "content": "Hi"}]}
    plain = to_body(GenerationRequest(prompt="Hello", sampling={"max_new_tokens": 4}))
    assert plain == {"model": "default", "prompt": "Hello", "max_tokens": 4}


def test_the_progress_line_says_done_failed_total_rate_and_time_left() -> None:
    batch = Batch(id="batch_1", endpoint=COMPLETIONS, input_file_id="file-1",
                  completion_window="24h", status="in_progress", created_at=0,
                  request_counts=RequestCounts(total=100, completed=20, failed=5))
    line = progress(BatchRecord(batch=batch, tenant="default", tokens=500), elapsed_s=10.0)
    assert line == ("batch_1 in_progress: 20 done / 5 failed / 100 total, 50.0 tokens/s, "
                    "ETA 30s")


def test_a_request_naming_a_stored_response_is_no_batch_line() -> None:
    request = GenerationRequest(prompt="Hi", response_id="resp_" + "0" * 32)
    with pytest.raises(InvalidRequest, match="response_id: a batch line is no stored response"):
        to_body(request)
