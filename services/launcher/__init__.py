"""``pdserve launch``: start and supervise a whole topology on one machine."""
