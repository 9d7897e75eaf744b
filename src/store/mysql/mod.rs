//! The MariaDB/MySQL store (feature `mysql`).
