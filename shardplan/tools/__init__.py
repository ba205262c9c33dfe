"""Tools on top of the API: the command line, report rendering, source emission, HLO reading, the launcher."""
