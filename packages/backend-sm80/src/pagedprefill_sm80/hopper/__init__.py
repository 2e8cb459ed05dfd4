"""The warp-specialised Hopper (sm90) kernel of the sm80 backend and its launcher."""
