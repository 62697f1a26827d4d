"""The Ray runtime (``runtime = "ray"``): the processes runtime's services as Ray actors."""
