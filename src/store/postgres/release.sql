UPDATE idempotency_keys
SET lease_owner = NULL, lease_expires_at = LEAST(lease_expires_at, statement_timestamp()),
    next_check_at = CASE WHEN $4::bigint IS NULL THEN NULL
        ELSE statement_timestamp() + $4::bigint * interval '1 millisecond' END,
    error = COALESCE($5::text, error), updated_at = statement_timestamp(),
    last_attempt_at = CASE WHEN $6::text = 'worker' THEN statement_timestamp()
        ELSE last_attempt_at END,
    may_have_acted = may_have_acted
    OR $6::text = 'worker', version = version + 1,
    history = CASE WHEN length(history) <= 14336 THEN history ELSE substr(right(history, 14336),
        strpos(right(history, 14336), E'\n') + 1) END || E'\n' || concat(version + 1, '|', state,
        '|', CASE WHEN retryable THEN '1' ELSE '0' END, '|', state, '|',
        CASE WHEN retryable THEN '1' ELSE '0' END, '|', lease_token, '|',
        floor(extract(epoch FROM statement_timestamp()) * 1000)::bigint, '|', length($6::text), '|',
        $6::text, '|' || replace(replace(left($7::text, 512), '\', '\\'), E'\n', '\n'))
WHERE scope = $1::text
    AND key = $2::text
    AND state = 'processing'
    AND lease_token = $3::bigint
