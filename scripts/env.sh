# Sourced by the scripts: Open MPI settings for running as root and oversubscribed on a small
# machine (more ranks than cores; ranks yield when idle instead of spinning).
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export OMPI_MCA_rmaps_base_oversubscribe=${OMPI_MCA_rmaps_base_oversubscribe:-1}
