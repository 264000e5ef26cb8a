-- One Postgres, two databases: MLflow's backend store and Prefect's.
CREATE DATABASE mlflow;
CREATE DATABASE prefect;
