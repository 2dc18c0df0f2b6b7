"""The client's gRPC channel and retry loop, built from the shared client
policy (_policy.py, generated from client/policy/client_policy.json): the
channel options (message size, gRPC's own retries of the read-only methods
via the service config, reconnect backoff), TLS credentials from PEM bytes,
text or files, the bearer-token interceptor, and retrying(), the loop that
stretches a call's retries over the client's retry deadline. Stateless apart
from the channel it returns: thread-safe."""
import os
import random
import time

import grpc

from . import _policy
from .errors import Error

# gRPC's own send cap (the daemon's replies are bounded by _policy.MAX_MESSAGE).
_MAX_SEND_MESSAGE = 64 << 20


def _read_pem(value):
    """PEM bytes from bytes, PEM text, or a file path."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value
    text = os.fspath(value)
    if "-----BEGIN" in text:
        return text.encode()
    with open(text, "rb") as f:
        return f.read()


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds "authorization: Bearer <token>" to every call."""

    def __init__(self, token):
        self._md = ("authorization", "Bearer " + token)

    def _details(self, d):
        md = list(d.metadata or ()) + [self._md]
        fields = {f: getattr(d, f, None) for f in
                  ("method", "timeout", "credentials", "wait_for_ready", "compression")}
        return _CallDetails(metadata=md, **fields)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


def channel_options(retry_deadline, extra=()):
    """The channel's options: message sizes, then (retry_deadline > 0)
    gRPC's retries of the read-only methods and a reconnect backoff capped
    as the retry loop's, then the caller's `extra` options."""
    opts = [("grpc.max_receive_message_length", _policy.MAX_MESSAGE),
            ("grpc.max_send_message_length", _MAX_SEND_MESSAGE)]
    if retry_deadline > 0:
        # Reconnect to a restarted daemon within the backoff cap instead
        # of gRPC's default (1 s growing to 120 s).
        opts += [("grpc.enable_retries", 1), ("grpc.service_config", _policy.SERVICE_CONFIG),
                 ("grpc.initial_reconnect_backoff_ms", int(_policy.RETRY_INITIAL_BACKOFF * 1000)),
                 ("grpc.max_reconnect_backoff_ms", int(_policy.RETRY_MAX_BACKOFF * 1000))]
    else:
        opts += [("grpc.enable_retries", 0)]
    return opts + list(extra)


def open_channel(target, options, *, unix_socket, tls, tls_ca, tls_cert, tls_key,
                 tls_server_name, token):
    """A channel to `target` with `options`: TLS when tls, tls_ca or
    tls_cert is given (not over a Unix socket), "authorization: Bearer
    <token>" on every call when token is. INVALID_ARGUMENT for TLS over a
    socket or half a client certificate."""
    if tls or tls_ca is not None or tls_cert is not None:
        if unix_socket:
            raise Error("INVALID_ARGUMENT", "TLS is for target=\"HOST:PORT\", not a socket")
        if (tls_cert is None) != (tls_key is None):
            raise Error("INVALID_ARGUMENT", "a client certificate needs tls_cert= and tls_key=")
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read_pem(tls_ca), private_key=_read_pem(tls_key),
            certificate_chain=_read_pem(tls_cert))
        if tls_server_name:
            options = list(options) + [("grpc.ssl_target_name_override", tls_server_name)]
        channel = grpc.secure_channel(target, creds, options=options)
    else:
        channel = grpc.insecure_channel(target, options=options)
    if token:
        channel = grpc.intercept_channel(channel, _BearerToken(token))
    return channel


def retrying(retry_deadline, attempt):
    """attempt(), again on Error UNAVAILABLE (or CANCELLED: _policy.RETRY_CODES)
    with backoff until retry_deadline seconds have passed; then UNAVAILABLE
    with the last error's message. retry_deadline <= 0: once."""
    if retry_deadline <= 0:
        return attempt()
    start = time.monotonic()
    deadline = start + retry_deadline
    backoff = _policy.RETRY_INITIAL_BACKOFF
    jitter = _policy.RETRY_JITTER
    tries = 0
    while True:
        tries += 1
        try:
            return attempt()
        except Error as e:
            if e.code not in _policy.RETRY_CODES:
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise Error("UNAVAILABLE", "%s (gave up after %d attempts in %.1f s)"
                            % (e.message or e.code, tries, time.monotonic() - start)) from None
        time.sleep(min(left, backoff * random.uniform(1 - jitter, 1 + jitter)))
        backoff = min(backoff * _policy.RETRY_MULTIPLIER, _policy.RETRY_MAX_BACKOFF)
