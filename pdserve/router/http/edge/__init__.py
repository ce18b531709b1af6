"""The HTTP edge's middleware: client authentication, body limits, request ids and
timeouts, admission, drain, cancellation, and the streaming write path."""
