"""Admin operations: typed (ops), run in the scheduler (dispatch), called from the HTTP process (http)."""
