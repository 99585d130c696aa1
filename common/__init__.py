"""Code shared by the scheduler, the parameter servers and the workers."""
