"""Model definitions that torchtitan does not ship (see ``models/wan22``)."""
