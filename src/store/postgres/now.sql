SELECT statement_timestamp()
