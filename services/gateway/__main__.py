"""``python -m pdserve.services.gateway``: same as ``pdserve gateway``."""

from pdserve.services.gateway.main import main

main()
