"""Log lines of both services: `--log-format text|json`, client strings escaped, one line per finished request.

Every line is one physical line whatever a client sends: in json each record is one JSON object (json.dumps
escapes control characters), in text the request id and the message have their control characters escaped
and a request line's values are quoted logfmt-style when they hold anything but plain characters. A request
id with a newline therefore never forges a second line. Tracebacks (exc_info) stay multi-line in text, as
they are ours; in json they are one escaped field.

No grpc here: the engine-core process configures its logging with this module too.
"""

import datetime
import json
import logging
import re
import time
from collections.abc import Callable

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(process)d %(name)s [%(request_id)s] %(message)s"
_PLAIN = re.compile(r"[A-Za-z0-9_.:/@+=-]+")
# C0 controls (tab kept), DEL and the C1 controls: what could break or fake a line on a terminal or in a file.
_CONTROL = {code: f"\\x{code:02x}" for code in [*range(0x00, 0x09), *range(0x0a, 0x20), *range(0x7f, 0xa0)]}
_CONTROL.update({ord("\n"): "\\n", ord("\r"): "\\r"})
_CONTROL.update({0x2028: "\\u2028", 0x2029: "\\u2029"})  # line and paragraph separators


def escape_value(value: str) -> str:
    """A client string fit for a text log line: as is when plain, else a JSON string literal (quoted, escaped)."""
    if value and _PLAIN.fullmatch(value):
        return value
    return json.dumps(value)


def escape_controls(text: str) -> str:
    """`text` with every control character (tab aside) written as an escape: it stays on one line."""
    return text.translate(_CONTROL)


class RequestIdFilter(logging.Filter):
    """Adds the current request id (from `get_request_id`, e.g. a context variable's get) as %(request_id)s."""

    def __init__(self, get_request_id: Callable[[], str], label: str | None = None):
        super().__init__()
        self._get_request_id = get_request_id
        self._label = label

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = self._label if self._label is not None else self._get_request_id()
        return True


class TextFormatter(logging.Formatter):
    """The classic line, with the request id and the message escaped (the traceback, if any, follows as is)."""

    def __init__(self):
        super().__init__(TEXT_FORMAT)
        self._second, self._second_text = None, ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """logging's default text (`2026-12-02 03:01:06,123`), its strftime done once per second (the handler's
        lock serializes format calls)."""
        second = int(record.created)
        if second != self._second:
            self._second_text = time.strftime(self.default_time_format, self.converter(record.created))
            self._second = second
        return self.default_msec_format % (self._second_text, record.msecs)

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_controls(record.message)
        request_id = record.__dict__.get("request_id", "-")
        record.request_id = request_id if request_id == "-" else escape_value(str(request_id))
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, pid, process, request_id, message, and a request line's fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "process": record.processName,
            "request_id": record.__dict__.get("request_id", "-"),
            "message": None,
        }
        fields = record.__dict__.get("request_fields")
        if fields:
            entry["message"] = "request finished"
            entry.update(fields)
        else:
            entry["message"] = record.getMessage()
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(level: str = "INFO", log_format: str = "text", get_request_id: Callable[[], str] = lambda: "-",
              label: str | None = None, stream=None) -> None:
    """Send every log record of this process to `stream` (stderr) as `log_format` lines.

    `label`, when given, stands in place of the request id (e.g. "engine-core", a process that serves none).
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, not {log_format!r}")
    # Per record, logging would find the caller's file and line and the thread's name: no line of ours prints them
    # (the logging documentation's "Optimization" section names these switches).
    logging._srcfile = None
    logging.logThreads = False
    handler = logging.StreamHandler(stream)
    handler.addFilter(RequestIdFilter(get_request_id, label))
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)


class _RequestLine:
    """A request line's text, rendered only if the record is emitted in text form."""

    __slots__ = ("fields",)

    def __init__(self, fields: dict):
        self.fields = fields

    def __str__(self) -> str:
        parts = []
        for key, value in self.fields.items():
            kind = type(value)
            if kind is str:
                parts.append(f"{key}={escape_value(value)}")
            elif kind is float:
                parts.append(f"{key}={value:.4f}")
            elif kind is int:
                parts.append(f"{key}={value}")
            elif value is not None:  # anything else (a str subclass too) is escaped like a client string
                parts.append(f"{key}={escape_value(str(value))}")
        return " ".join(parts)


def log_request(logger: logging.Logger, fields: dict) -> None:
    """One line for one finished request: `request finished: key=value ...` in text, `fields` at the top in json."""
    if logger.isEnabledFor(logging.INFO):
        logger.info("request finished: %s", _RequestLine(fields), extra={"request_fields": fields})
