"""Admission queue bounds and QoS class parsing; the server flags that configure them."""

from __future__ import annotations

import gc

import pytest

from argosy.api.errors import headers_of, openai_error_body, status_of
from argosy.cli import build_parser, configs_from_args, parse_duration
from argosy.core.admission import AdmissionQueue, request_qos
from argosy.errors import InvalidRequestError, OverloadedError


def test_the_queue_refuses_past_its_bound_and_a_started_ticket_frees_its_place() -> None:
    queue = AdmissionQueue(max_waiting=2)
    first, second = queue.admit(), queue.admit()
    with pytest.raises(OverloadedError) as caught:
        queue.admit()
    assert status_of(caught.value) == 503
    assert headers_of(caught.value) == {"retry-after": "1"}
    assert openai_error_body(caught.value)["error"]["type"] == "server_error"
    first.started()
    first.started()  # idempotent
    first.release()
    assert queue.num_waiting == 1
    third = queue.admit()
    second.release()
    third.release()
    assert queue.num_waiting == 0


def test_a_forgotten_ticket_leaves_the_queue() -> None:
    queue = AdmissionQueue(max_waiting=1)
    queue.admit()  # never used: garbage
    gc.collect()
    assert queue.num_waiting == 0
    assert AdmissionQueue(max_waiting=0).max_waiting == 0


def test_qos_from_field_or_header() -> None:
    assert request_qos(None, None) == "interactive"
    assert request_qos(None, " background ") == "background"
    assert request_qos("inline", "background") == "inline"  # the field wins
    with pytest.raises(InvalidRequestError) as caught:
        request_qos("urgent", None)
    assert caught.value.param == "priority"
    with pytest.raises(InvalidRequestError) as caught:
        request_qos(2, None)
    assert caught.value.param == "priority" and "(int)" in caught.value.message
    with pytest.raises(InvalidRequestError) as caught:
        request_qos(None, "realtime")
    assert caught.value.param == "x-argosy-qos"


def test_session_and_admission_flags() -> None:
    assert parse_duration("30d") == 30 * 86400
    assert parse_duration("1.5h") == 5400
    assert parse_duration("600") == 600
    parser = build_parser()
    args = parser.parse_args(
        [
            "serve",
            "--data-dir",
            "/tmp/x",
            "--session-ttl",
            "2h",
            "--session-max-bytes",
            "1G",
            "--max-queued-requests",
            "3",
            "--request-timeout",
            "90s",
        ]
    )
    _, server, _ = configs_from_args(parser, args)
    assert (server.data_dir, server.session_ttl, server.session_max_bytes) == ("/tmp/x", 7200, 2**30)
    assert (server.max_queued_requests, server.request_timeout) == (3, 90)
    _, defaults, _ = configs_from_args(parser, parser.parse_args(["serve"]))
    assert defaults.data_dir == "~/.local/share/argosy" and defaults.session_ttl == 30 * 86400
    assert (defaults.max_queued_requests, defaults.request_timeout) == (256, 600)
    with pytest.raises(SystemExit):
        configs_from_args(parser, parser.parse_args(["serve", "--request-timeout", "0"]))
