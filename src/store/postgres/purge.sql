WITH picked AS MATERIALIZED (SELECT scope,
    key FROM idempotency_keys WHERE state <> 'processing' AND expires_at <= statement_timestamp()
    ORDER BY expires_at LIMIT $1::bigint FOR UPDATE SKIP LOCKED),
    gone AS (DELETE FROM idempotency_keys k USING picked WHERE k.scope = picked.scope
        AND k.key = picked.key AND k.state <> 'processing' RETURNING k.scope, k.key,
        k.version + 1 AS seq, k.history || E'\n' || concat(k.version + 1, '|', k.state, '|',
        CASE WHEN k.retryable THEN '1' ELSE '0' END, '|', NULL, '|', NULL, '|', k.lease_token, '|',
        floor(extract(epoch FROM statement_timestamp()) * 1000)::bigint, '|', length('purge'), '|',
        'purge', '|' || replace(replace(left('retention expired', 512), '\', '\\'), E'\n',
        '\n')) AS history)
INSERT INTO idempotency_key_tombstones AS t (scope, key, last_seq, history)
SELECT scope, key, seq, history
FROM gone
ON CONFLICT (scope, key)
DO
UPDATE
SET last_seq = excluded.last_seq,
    history = CASE WHEN length(t.history) <= 14336 THEN t.history ELSE substr(right(t.history,
        14336), strpos(right(t.history, 14336), E'\n') + 1) END || E'\n' || excluded.history
