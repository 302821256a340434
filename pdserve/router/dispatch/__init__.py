"""The dispatch: a pure state machine (events in, messages out), membership, policies."""
