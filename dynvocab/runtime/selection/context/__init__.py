"""The strategies that read the request's context, each one selector for every host over one per-request window
(:mod:`.window`: ``microspec``; :mod:`.hybrid`): each host pushes the stream it sees."""
