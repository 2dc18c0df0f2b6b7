"""The one exception type of the weightd client."""
import grpc

# Canonical status codes (absl / gRPC share the numbering).
_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


def code_name(code):
    """Canonical name ("NOT_FOUND") of an int code or a grpc.StatusCode."""
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, str):
        return code
    return _CODE_NAMES.get(int(code), "UNKNOWN")


class Error(Exception):
    """A failed weightd call.

    `code` is the canonical status name ("NOT_FOUND", "INVALID_ARGUMENT",
    "UNAVAILABLE", ...), `message` the daemon's (or client's) text. str(err)
    reads like weightctl's error line: "NOT_FOUND: model "x" is not loaded".
    """

    def __init__(self, code, message=""):
        self.code = code_name(code)
        self.message = message
        super().__init__("%s: %s" % (self.code, message) if message else self.code)

    def __reduce__(self):
        return (Error, (self.code, self.message))


def from_grpc(err, context=None):
    """Converts a grpc.RpcError (or anything else) into Error."""
    if isinstance(err, Error):
        return err
    if isinstance(err, grpc.RpcError) and hasattr(err, "code"):
        try:
            code = err.code()
            details = err.details() or ""
        except Exception:  # a non-call RpcError
            code, details = grpc.StatusCode.UNKNOWN, str(err)
        name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
        msg = details if context is None else "%s: %s" % (context, details)
        return Error(name, msg)
    msg = str(err) if context is None else "%s: %s" % (context, err)
    return Error("UNKNOWN", msg)
