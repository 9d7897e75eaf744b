SELECT GET_LOCK(CONCAT('idemflow.migrate.', SHA1(DATABASE())), ?)
