"""What more than one service shares: the scheduler services' loop, ranks and conversions, and the
gateway's chat-output flags that ``pdserve launch`` passes on."""
