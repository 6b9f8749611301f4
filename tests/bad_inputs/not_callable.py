"""Bad input: the name after the colon is not a function."""
build = 3
