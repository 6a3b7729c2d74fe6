"""The knowledge library: entries kept as trusted contexts (format, index) and the
library service behind LibraryAdd, LibraryList, LibraryRemove and Ask.

May import kvgraftd.engine and below.
"""
