SELECT CAST(unixepoch('subsec') * 1000 AS INTEGER)
