"""What more than one service shares: the scheduler services' loop, ranks and conversions, the
gateway's chat-output flags that ``pdserve launch`` passes on, and the supervision of service
processes (``supervision``)."""
