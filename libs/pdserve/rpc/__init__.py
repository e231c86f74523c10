"""gRPC plumbing shared by every service: server bootstrap, health, reflection, client streams."""
