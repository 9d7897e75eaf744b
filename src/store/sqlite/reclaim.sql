UPDATE idempotency_keys
SET state = 'processing', retryable = 0, request = COALESCE(?7, request),
    provider_key = CASE
        WHEN state = 'failed' AND provider IS NOT ?4 THEN (CASE
            WHEN ?12 IS NULL THEN ?5
            WHEN length(provider_key) <= length(?5) THEN provider_key
            ELSE ?12 || printf('%08x', (version + 1) & 4294967295) END)
        ELSE provider_key END,
    provider = CASE WHEN state = 'failed' THEN ?4 ELSE provider END, lease_token = lease_token + 1,
    lease_owner = ?8, lease_expires_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) + ?9,
    attempts = attempts + 1, updated_at = CAST(unixepoch('subsec') * 1000 AS INTEGER),
    expires_at = NULL, next_check_at = NULL, error = NULL, response_status = NULL,
    response_headers = NULL, response_body = NULL, retention_ms = ?10, version = version + 1,
    last_attempt_at = CAST(unixepoch('subsec') * 1000 AS INTEGER),
    may_have_acted = CASE WHEN state = 'failed' THEN may_have_acted ELSE 1 END,
    history = CASE
            WHEN length(history) <= 14336 THEN history
            ELSE substr(substr(history, -14336), instr(substr(history, -14336), char(10)) + 1) END
        || char(10)
        || printf('%s|%s|%s|%s|%s|%s|%s|%s|%s%s', version + 1, state, retryable, 'processing',
            '0', lease_token + 1, CAST(unixepoch('subsec') * 1000 AS INTEGER), length('worker'),
            'worker',
            ifnull('|' || replace(replace(substr(CASE WHEN ?13 = 'failed'
                THEN 'reclaimed after a retryable failure'
                ELSE 'retry took over an expired lease' END, 1, 512), '\', '\\'), char(10), '\n'),
                ''))
WHERE scope = ?1
    AND key = ?2
    AND state = ?13
    AND fingerprint = ?6
    AND ( (state = 'failed' AND retryable = 1 AND (provider IS ?4 OR may_have_acted = 0))
        OR (?11 IS NOT NULL AND state = 'processing' AND provider IS ?4
            AND lease_expires_at <= CAST(unixepoch('subsec') * 1000 AS INTEGER)
            AND created_at > CAST(unixepoch('subsec') * 1000 AS INTEGER) - ?11))
RETURNING lease_token, lease_expires_at, attempts, provider_key, may_have_acted,
    CASE WHEN ?13 = 'failed' THEN 'reclaimed after a retryable failure'
        ELSE 'retry took over an expired lease' END AS last_reason,
    created_at
