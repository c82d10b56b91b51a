"""Rules for the backward ops autograd emits on the lazy device."""
