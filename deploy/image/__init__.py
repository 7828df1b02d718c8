"""Building and running the server's image with docker or podman (`make
image`, the image test, `make bench BENCH=image`): standard library only."""
