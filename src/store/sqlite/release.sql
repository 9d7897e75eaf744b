UPDATE idempotency_keys
SET lease_owner = NULL,
    lease_expires_at = MIN(lease_expires_at, CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    next_check_at = CASE WHEN ?4 IS NULL THEN NULL
        ELSE CAST(unixepoch('subsec') * 1000 AS INTEGER) + ?4 END,
    error = COALESCE(?5, error), updated_at = CAST(unixepoch('subsec') * 1000 AS INTEGER),
    last_attempt_at = CASE WHEN ?6 = 'worker' THEN CAST(unixepoch('subsec') * 1000 AS INTEGER)
        ELSE last_attempt_at END,
    may_have_acted = CASE WHEN ?6 = 'worker' THEN 1 ELSE may_have_acted END, version = version + 1,
    history = CASE WHEN length(history) <= 14336 THEN history ELSE substr(substr(history, -14336),
        instr(substr(history, -14336),
        char(10)) + 1) END || char(10) || printf('%s|%s|%s|%s|%s|%s|%s|%s|%s%s', version + 1, state,
        retryable, state, retryable, lease_token, CAST(unixepoch('subsec') * 1000 AS INTEGER),
        length(?6), ?6, ifnull('|' || replace(replace(substr(?7, 1, 512), '\', '\\'), char(10),
        '\n'), ''))
WHERE scope = ?1
    AND key = ?2
    AND state = 'processing'
    AND lease_token = ?3
