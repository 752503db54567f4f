"""The socket factory: options applied, every socket tracked until closed, shutdown closes
what is left, bad arguments and bad config fail loudly."""

from __future__ import annotations

import logging

import pytest
import zmq

from yatt.errors import Closed, ConfigError, TransportError
from yatt.runtime.configtools import build
from yatt.runtime.transport import Transport, TransportConfig, bound_endpoint


async def test_factory_applies_options_and_tracks_sockets(transport: Transport) -> None:
    router = transport.socket(zmq.ROUTER, bind="tcp://127.0.0.1:*", hwm=7, linger_ms=0)
    dealer = transport.socket(zmq.DEALER, connect=bound_endpoint(router), identity=b"me")
    assert router.getsockopt(zmq.SNDHWM) == 7 and router.getsockopt(zmq.RCVHWM) == 7
    assert router.getsockopt(zmq.LINGER) == 0
    assert dealer.getsockopt(zmq.SNDHWM) == transport.config.hwm
    assert dealer.getsockopt(zmq.LINGER) == transport.config.linger_ms
    assert dealer.getsockopt(zmq.IDENTITY) == b"me"
    endpoint = bound_endpoint(router)
    assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":*")
    assert transport.open_sockets() == ["ROUTER bind tcp://127.0.0.1:*", f"DEALER connect {endpoint}"]

    # The identity really is the one the ROUTER sees.
    await dealer.send_multipart([b"hello"])
    assert await router.recv_multipart() == [b"me", b"hello"]

    transport.close_socket(dealer)
    transport.close_socket(dealer)  # idempotent
    assert dealer.closed
    assert transport.open_sockets() == ["ROUTER bind tcp://127.0.0.1:*"]
    router.close()  # closed behind the factory's back: still not reported as open
    assert transport.open_sockets() == []


async def test_close_closes_every_socket_left_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    transport = Transport()
    a = transport.socket(zmq.PUB, bind="inproc://a")
    b = transport.socket(zmq.SUB, connect="inproc://a", subscribe=(b"x",))
    with caplog.at_level(logging.WARNING, logger="yatt.runtime.transport"):
        transport.close()
    assert a.closed and b.closed and transport.ctx.closed and transport.closed
    assert "2 socket(s) still open" in caplog.text
    with pytest.raises(Closed, match="transport is closed"):
        transport.socket(zmq.PUB, bind="inproc://b")
    transport.close()  # idempotent


async def test_each_transport_has_its_own_context() -> None:
    async with Transport() as one, Transport() as two:
        assert one.ctx is not two.ctx
        # inproc endpoints are per context: two transports do not see each other's.
        s1 = one.socket(zmq.PAIR, bind="inproc://same")
        s2 = two.socket(zmq.PAIR, bind="inproc://same")
        one.close_socket(s1)
        two.close_socket(s2)


async def test_bad_arguments_and_bind_failures_name_the_problem(transport: Transport) -> None:
    with pytest.raises(ValueError, match="exactly one of bind= or connect="):
        transport.socket(zmq.DEALER)
    with pytest.raises(ValueError, match="exactly one of bind= or connect="):
        transport.socket(zmq.DEALER, bind="inproc://x", connect="inproc://x")
    first = transport.socket(zmq.ROUTER, bind="tcp://127.0.0.1:*")
    taken = bound_endpoint(first)
    with pytest.raises(TransportError, match=f"cannot bind ROUTER to '{taken}'"):
        transport.socket(zmq.ROUTER, bind=taken)
    with pytest.raises(TransportError, match="cannot connect DEALER to 'nonsense://x'"):
        transport.socket(zmq.DEALER, connect="nonsense://x")
    # The failed sockets were closed, not leaked.
    assert transport.open_sockets() == ["ROUTER bind tcp://127.0.0.1:*"]
    transport.close_socket(first)


async def test_plain_bind_beyond_loopback_warns(
    transport: Transport, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="yatt.runtime.transport"):
        local = transport.socket(zmq.ROUTER, bind="tcp://127.0.0.1:*")
        assert "without encryption" not in caplog.text
        exposed = transport.socket(zmq.ROUTER, bind="tcp://0.0.0.0:*")
    assert "binding tcp://0.0.0.0:* without encryption" in caplog.text
    assert "transport.curve=true" in caplog.text
    transport.close_socket(local)
    transport.close_socket(exposed)


def test_config_is_validated_by_field() -> None:
    config = build(TransportConfig, {"hwm": 10, "heartbeat_interval_s": 0.5, "heartbeat_misses": 4})
    assert config.hwm == 10 and config.peer_silence_limit_s == 2.0
    with pytest.raises(ConfigError, match=r"transport\.heartbeat_misses must be >= 1 \(got 0\)"):
        build(TransportConfig, {"heartbeat_misses": 0}, "transport")
    with pytest.raises(ConfigError, match=r"transport\.curve_keys_dir is required when curve is on"):
        build(TransportConfig, {"curve": True}, "transport")
    with pytest.raises(ConfigError, match=r"transport\.stream_credit must be >= 1"):
        build(TransportConfig, {"stream_credit": 0}, "transport")
    with pytest.raises(
        ConfigError, match=r"unknown config key transport\.hwn; did you mean transport\.hwm\?"
    ):
        build(TransportConfig, {"hwn": 1}, "transport")
