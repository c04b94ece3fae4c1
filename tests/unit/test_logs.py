"""Log lines (services.common.logs): json lines parse and carry a request's fields; client strings never break a line."""

import io
import json
import logging

import pytest

from services.common import logs

FIELDS = {"request_id": "r-1", "code": "OK", "finish_reason": "stop", "prompt_tokens": 7, "completion_tokens": 3,
          "cached_tokens": 4, "ttft_s": 0.0125, "e2e_s": 0.25, "engine": "10.0.0.7:50052"}
FORGED = 'evil\n2026-01-01 00:00:00,000 INFO 1 forged [x] request finished: {"forged": true}\r'


@pytest.fixture
def capture():
    """configure() into a buffer for one test; the root logger's handlers are restored afterwards."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    buffer = io.StringIO()
    request_id = {"value": "-"}

    def configure(log_format: str, label: str | None = None) -> io.StringIO:
        logs.configure("INFO", log_format, lambda: request_id["value"], label, stream=buffer)
        return buffer

    configure.request_id = request_id
    yield configure
    root.handlers[:], root.level = saved


def lines_of(buffer: io.StringIO) -> list[str]:
    return buffer.getvalue().splitlines()


def test_a_json_request_line_is_one_object_with_every_field(capture):
    buffer = capture("json")
    capture.request_id["value"] = "r-1"
    logs.log_request(logging.getLogger("services.engine.serving.server"), FIELDS)
    [line] = lines_of(buffer)
    entry = json.loads(line)
    assert {key: entry[key] for key in FIELDS} == FIELDS
    assert entry["message"] == "request finished" and entry["level"] == "INFO"
    assert entry["logger"] == "services.engine.serving.server" and isinstance(entry["pid"], int)


def test_every_json_line_parses_even_with_a_traceback(capture):
    buffer = capture("json")
    logger = logging.getLogger("test.logs")
    logger.info("plain %s", "message")
    try:
        raise ValueError("boom\nline two")
    except ValueError:
        logger.exception("failed")
    entries = [json.loads(line) for line in lines_of(buffer)]
    assert [entry["message"] for entry in entries] == ["plain message", "failed"]
    assert "ValueError: boom" in entries[1]["exc_info"]


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_an_id_with_a_newline_stays_on_one_line(capture, log_format):
    buffer = capture(log_format)
    capture.request_id["value"] = FORGED
    logs.log_request(logging.getLogger("test.logs"), dict(FIELDS, request_id=FORGED))
    logging.getLogger("test.logs").info("rejected: %s", FORGED)
    lines = lines_of(buffer)
    assert len(lines) == 2, lines
    assert not any(line.startswith("2026-01-01") for line in lines)
    if log_format == "json":
        entries = [json.loads(line) for line in lines]
        assert entries[0]["request_id"] == FORGED and entries[1]["request_id"] == FORGED
        assert entries[1]["message"] == f"rejected: {FORGED}"
    else:
        assert f"request_id={json.dumps(FORGED)}" in lines[0]
        assert f"[{json.dumps(FORGED)}]" in lines[1]


def test_a_text_request_line_has_key_value_pairs_and_skips_missing_ones(capture):
    buffer = capture("text")
    capture.request_id["value"] = "r-1"
    logs.log_request(logging.getLogger("test.logs"), dict(FIELDS, ttft_s=None, engine="host a:1"))
    [line] = lines_of(buffer)
    assert line.endswith('[r-1] request finished: request_id=r-1 code=OK finish_reason=stop prompt_tokens=7 '
                         'completion_tokens=3 cached_tokens=4 e2e_s=0.2500 engine="host a:1"')


def test_a_label_stands_in_for_the_request_id(capture):
    buffer = capture("text", label="engine-core")
    logging.getLogger("test.logs").warning("core says %d", 1)
    assert lines_of(buffer)[0].endswith("test.logs [engine-core] core says 1")


def test_escape_value_leaves_plain_strings_and_quotes_the_rest():
    assert logs.escape_value("req-1_a.b:c/d@e+f=g") == "req-1_a.b:c/d@e+f=g"
    assert logs.escape_value("") == '""'
    assert logs.escape_value('a "b"') == '"a \\"b\\""'
    assert logs.escape_value("é\u2028") == '"\\u00e9\\u2028"'
    assert logs.escape_controls("a\tb\nc\x1bd\u2028") == "a\tb\\nc\\x1bd\\u2028"


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError):
        logs.configure("INFO", "xml")


def test_the_text_time_is_loggings_default_across_seconds():
    """The formatter keeps one strftime per second: within a second, across one, and back again."""
    ours, default = logs.TextFormatter(), logging.Formatter()
    for created in [1764644466.0, 1764644466.123, 1764644466.999, 1764644467.0005, 1764644467.5, 1764644400.25]:
        record = logging.makeLogRecord({})
        record.created, record.msecs = created, int((created - int(created)) * 1000) + 0.0
        assert ours.formatTime(record) == default.formatTime(record), created


def test_a_field_of_another_type_is_escaped_like_a_client_string(capture):
    class Name(str):
        pass

    class Thing:
        def __str__(self) -> str:
            return "x\nFORGED"

    buffer = capture("text")
    logs.log_request(logging.getLogger("test.logs"), dict(FIELDS, code=Name("a\nb"), engine=Thing()))
    [line] = lines_of(buffer)
    assert 'code="a\\nb"' in line and 'engine="x\\nFORGED"' in line
