"""graphgrow's built-in passes (installed as graphgrow.passes, registered through entry points)."""
